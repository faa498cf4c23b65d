"""The prompts a policy sent to each pod that have not started decoding, in order, and
how much of a cached prefix survives them.

vLLM schedules FCFS and evicts unreferenced blocks LRU (a freed request's tail first).
So a prompt routed to a pod finds its cached prefix at prefill only if the blocks the
requests queued ahead of it touch *after the prefix was last touched* leave room for it.
The last touch is the prefill of the newest queued request that carries the whole
prefix (a *carrier*); with no carrier queued it is in the past, and every queued
request comes after it.  :meth:`QueuedPrompts.surviving` walks the pod's queue from the
newest request back to the newest carrier, counting the blocks those requests do not
share with the prompt, and keeps ``capacity - that`` of the prefix.

Block keys are chains (:mod:`scoring.blocks`), so the blocks two queued prompts share
beyond the point where they leave this prompt are found without a set: prompts that
leave it at the same block with the same key count once, by the longest (the same
retrieved document with different questions, the same conversation's turns).

``cost`` uses this only without a hot set (``hot_window_s: 0``).  With one, the prefix's
LRU distance (:meth:`scoring.policies.hot_set.HotBlocks.newer`) replaces it: it also
counts the requests already served after the prefix, whose blocks are newer in the LRU.
"""

from __future__ import annotations

from collections.abc import Sequence

from scoring.policies.inflight import shared_blocks


class QueuedPrompts:
    """Per pod, the block-key chains of the requests routed there and not yet past
    prefill, oldest first (``pods``: pod -> {request key: chain})."""

    __slots__ = ("_where", "pods")

    def __init__(self) -> None:
        self.pods: dict[str, dict[object, Sequence[int]]] = {}
        self._where: dict[object, str] = {}  # request key -> its pod

    def add(self, pod: str, key: object, keys: Sequence[int]) -> None:
        """Request ``key`` carrying ``keys`` was routed to ``pod`` (newest); routed
        again (a retry), it leaves the queue it was in."""
        if key in self._where:
            self.remove(key)
        if keys:
            self.pods.setdefault(pod, {})[key] = keys
            self._where[key] = pod

    def remove(self, key: object) -> None:
        """Request ``key`` reached its first token, completed or failed (nothing when
        it is not queued)."""
        pod = self._where.pop(key, None)
        if pod is None:
            return
        queue = self.pods.get(pod)
        if queue is not None and queue.pop(key, None) is not None and not queue:
            del self.pods[pod]

    def surviving(self, pod: str, keys: Sequence[int], cached: int, capacity: int) -> int:
        """:func:`surviving` over ``pod``'s queue."""
        queue = self.pods.get(pod)
        return surviving(queue, keys, cached, capacity) if queue else cached

    def forget(self, pod: str) -> None:
        for key in self.pods.pop(pod, {}):
            self._where.pop(key, None)


def surviving(
    queue: dict[object, Sequence[int]], keys: Sequence[int], cached: int, capacity: int
) -> int:
    """Of the ``cached`` leading blocks of ``keys``, those still cached when it prefills
    after ``queue`` (oldest first): ``min(cached, capacity - newer)``, ``newer`` the
    blocks the queued requests after the newest carrier touch and ``keys`` does not
    share."""
    if cached <= 0:
        return cached
    newer = 0
    longest: dict[tuple[int, int], int] = {}
    for chain in reversed(queue.values()):
        s = shared_blocks(chain, keys)
        if s >= cached:
            break  # a carrier: it touches the prefix after everything older
        rest = len(chain) - s
        if rest <= 0:
            continue  # a prefix of this prompt: it touches nothing else
        at = (s, chain[s])
        seen = longest.get(at, 0)
        if rest > seen:
            newer += rest - seen
            longest[at] = rest
            if newer >= capacity:
                return 0
    keep = capacity - newer
    return cached if keep >= cached else keep
