"""The one interface every index backend implements.

Semantics (the shared behaviour suite in ``tests/scoring/test_index_behaviour.py``
holds every backend to them):

* A (pod, key, tier) entry is *counted*: vLLM may store the same block hash twice on
  one pod (it does not dedupe physical blocks) and removes per physical block, so
  ``add`` increments and ``remove`` decrements; the entry exists while its count > 0.
* ``lookup(keys)`` walks the chain from block 0 and returns, for every pod that holds
  block 0 in some tier, a :data:`PodHits`: ``{tier: n}`` where ``n`` is the number of
  leading blocks the pod can serve using that tier *or any faster one* (tiers ordered
  as in ``tiers``, fastest first). So ``hits["GPU"] <= hits["CPU"]`` always, and
  ``hits["CPU"] - hits["GPU"]`` blocks would have to be loaded from CPU memory.
  Pods holding nothing are omitted.  ``pods`` restricts the answer to candidates.
* ``clear_pod(pod)`` forgets everything about a pod (engine restart, pod gone);
  with ``tier`` only that tier.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Protocol, runtime_checkable

#: Storage tiers, fastest first.  vLLM reports ``medium`` "GPU" (also on CPU engines)
#: or "CPU" for an offloaded copy; connectors may add slower ones.
DEFAULT_TIERS: tuple[str, ...] = ("GPU", "CPU", "DISK")

#: tier -> number of leading blocks servable from that tier or faster ones.
PodHits = dict[str, int]


@runtime_checkable
class BlockIndex(Protocol):
    """Async index of (pod, block key, tier) -> count."""

    tiers: tuple[str, ...]

    async def add(self, pod: str, keys: Sequence[int], tier: str = "GPU") -> None:
        """Count one more stored copy of each key on ``pod`` in ``tier``."""
        ...

    async def remove(self, pod: str, keys: Sequence[int], tier: str = "GPU") -> None:
        """Count one copy fewer; unknown keys are ignored."""
        ...

    async def clear_pod(self, pod: str, tier: str | None = None) -> None:
        """Forget every entry of ``pod`` (only ``tier`` when given)."""
        ...

    async def lookup(
        self, keys: Sequence[int], pods: Collection[str] | None = None
    ) -> dict[str, PodHits]:
        """For each pod holding a prefix of ``keys``: leading blocks per tier."""
        ...

    async def pod_entries(self) -> dict[str, int]:
        """Number of distinct (key, tier) entries held per pod (for metrics)."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...
