"""Refusing KV-event batches that contradict what the pod can hold.

The subscriber knows two facts about a pod's engine from its ``/metrics``
(``vllm:cache_config_info``, see :mod:`router.fleet.scrape`): ``num_gpu_blocks``, the
KV cache's size in blocks, and ``block_size``.  A batch that contradicts them is not
applied, counted by reason (``kvroute_event_rejected_total{pod,reason}``), and the pod
resynced (its stream and our view of it disagree, so what we hold for it is suspect):

* ``block_size``: a ``BlockStored`` with tokens whose ``block_size`` is not the pod's
  (checked before applying: its keys could never match a prompt's anyway);
* ``capacity``: a ``BlockStored`` naming more blocks than the whole cache (checked
  before applying), or a batch after which the distinct GPU blocks we hold for the pod
  exceed ``num_gpu_blocks`` (checked after the applier computed the batch and before its index
  writes run, by sinks that offer ``apply_checked``: :class:`router.events.IndexSink`).
  vLLM evicts before it stores within a step, so a consistent stream never exceeds it;
  a forged or corrupt one (one message claiming 2,000 tokens on a pod that holds 32),
  or a view that missed removals, does.

Facts unknown (the pod was not scraped yet) mean no check.  An engine configured with
``kv_cache_report_mode="full"`` re-announces prefix-cache hits as stores and would trip
the capacity check; vLLM's default ("incremental") does not.
"""

from __future__ import annotations

from typing import Any, Protocol

from scoring.events.decode import BlockStored

#: the media vLLM's own KV cache reports (``medium`` absent = GPU)
GPU_MEDIA = (None, "GPU")


class PodFacts(Protocol):
    """What the scraper learned about a pod's cache (``router.fleet.scrape.Scraped``)."""

    @property
    def capacity_blocks(self) -> int | None: ...

    @property
    def block_size(self) -> int | None: ...


class BatchRejected(ValueError):
    """A batch contradicts its pod's facts; ``reason`` is one of
    :data:`router.events.stats.REJECT_REASONS`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def precheck(batch: Any, facts: PodFacts | None) -> None:
    """Raise :class:`BatchRejected` when one event of ``batch`` (decoded, with
    ``.events``) contradicts ``facts``."""
    if facts is None:
        return
    capacity = facts.capacity_blocks
    block_size = facts.block_size
    for ev in batch.events:
        if not isinstance(ev, BlockStored):
            continue
        if block_size and ev.token_ids and ev.block_size and ev.block_size != block_size:
            raise BatchRejected(
                "block_size",
                f"BlockStored with block_size {ev.block_size}; the pod's is {block_size}",
            )
        if capacity and ev.medium in GPU_MEDIA and len(ev.block_hashes) > capacity:
            raise BatchRejected(
                "capacity",
                f"BlockStored of {len(ev.block_hashes)} blocks; the pod's cache holds {capacity}",
            )


def check_held(held: int, facts: PodFacts | None) -> None:
    """Raise :class:`BatchRejected` when ``held`` distinct GPU blocks exceed the pod's cache."""
    capacity = facts.capacity_blocks if facts is not None else None
    if capacity and held > capacity:
        raise BatchRejected(
            "capacity",
            f"the pod would hold {held} GPU blocks; its cache holds {capacity}",
        )
