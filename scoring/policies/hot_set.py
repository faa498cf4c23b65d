"""The hot working set a router has sent to each pod, and what it means for room.

A pod's KV cache holds three kinds of blocks: blocks held by running requests (vLLM's
``kv_cache_usage_perc``), cached blocks that requests will soon reuse (the *hot* ones:
the next turn of a conversation in progress, a shared system prompt), and cached
blocks nobody will ask for again (*cold*: old traffic, or prompts sent to the pod by
someone else).  vLLM evicts unreferenced blocks LRU, so a new prefix placed on a pod
costs nothing when it displaces cold blocks and costs a recompute per hot block it
displaces.

The engine's counters cannot tell hot from cold; the router can, for what it routed:
:class:`HotBlocks` remembers, per pod, the block keys of the requests routed there in
the last ``window_s`` seconds (each key once, with the time it was last routed).  That
count is a lower bound of the pod's hot set (other routers' traffic is not in it).

* :func:`room` — free blocks for a new prefix: ``min(free_blocks(view), capacity -
  hot)``: a block is taken when a running request holds it (vLLM) or when this router
  sent it there within the window; cold cache is free.
* :func:`evicted_hot` — the hot blocks a request's uncached blocks would push out of a
  pod: ``clamp(hot + new - capacity, 0, new)``.  Each is a miss some later request pays.

``window_s`` defaults to 300 s: the lifetime hosted LLM APIs give an unused cached
prefix (Anthropic's prompt cache lives 5 minutes, refreshed on each use; OpenAI's docs
say cached prefixes stay active for 5 to 10 minutes of inactivity) — their estimate of
how long a prefix stays worth keeping, not a number measured here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from scoring.policies.base import PodView
from scoring.policies.room import free_blocks

#: a pod's remembered keys are bounded (memory) when its capacity is unknown
MAX_KEYS_PER_POD = 1 << 20
_INF = float("inf")


class HotBlocks:
    """Per pod: the distinct block keys routed there in the last ``window_s`` seconds.

    Bookkeeping is incremental: :meth:`routed` costs one dictionary update per key, and
    :meth:`count` is a comparison with the time the pod's oldest key leaves the window
    (kept per pod) until that time passes; only then are the expired keys dropped."""

    def __init__(self, window_s: float, max_keys: int = MAX_KEYS_PER_POD) -> None:
        self.window_s = window_s
        self.max_keys = max_keys
        self._pods: dict[str, OrderedDict[int, float]] = {}
        # pod -> when its oldest remembered key leaves the window (absent: no keys)
        self._next_expiry: dict[str, float] = {}

    def routed(
        self, pod: str, keys: Sequence[int], now: float, capacity: int | None = None
    ) -> None:
        """``keys`` were routed to ``pod`` at ``now``.  With the pod's ``capacity``
        known, only the most recent ``2 * capacity`` keys are kept: a pod whose hot set
        is twice its cache has no room and evicts a hot block per new one either way."""
        seen = self._pods.get(pod)
        if seen is None:
            seen = self._pods[pod] = OrderedDict()
        move = seen.move_to_end
        for k in keys:
            if k in seen:
                move(k)
            seen[k] = now
        limit = self.max_keys if capacity is None else min(self.max_keys, 2 * capacity)
        while len(seen) > limit:
            seen.popitem(last=False)
        self._expire(pod, seen, now)

    def count(self, pod: str, now: float) -> int:
        """Distinct keys routed to ``pod`` within the window before ``now``."""
        if now < self._next_expiry.get(pod, -_INF):
            return len(self._pods[pod])
        seen = self._pods.get(pod)
        if not seen:
            return 0
        self._expire(pod, seen, now)
        return len(seen)

    def forget(self, pod: str) -> None:
        self._pods.pop(pod, None)
        self._next_expiry.pop(pod, None)

    def _expire(self, pod: str, seen: OrderedDict[int, float], now: float) -> None:
        horizon = now - self.window_s
        while seen:
            t = seen[next(iter(seen))]
            if t >= horizon:
                self._next_expiry[pod] = t + self.window_s
                return
            seen.popitem(last=False)
        self._next_expiry.pop(pod, None)


def room(view: PodView, hot: int) -> float | None:
    """Free blocks for a new prefix on ``view``'s pod: vLLM's free blocks less the hot
    ones this router routed there (``None`` when the pod's free room is unknown)."""
    free = free_blocks(view)
    if free is None or view.capacity_blocks is None:
        return free
    return min(free, float(view.capacity_blocks - hot))


def evicted_hot(hot: int, new: int, capacity: int | None) -> int:
    """Hot blocks that ``new`` freshly computed blocks push out of a pod whose hot set
    is ``hot`` blocks and cache ``capacity`` blocks (0 when the capacity is unknown)."""
    if capacity is None or new <= 0:
        return 0
    over = hot + new - capacity
    return 0 if over <= 0 else min(over, new)


def most_room(tied: Sequence[PodView], hot: dict[str, int]) -> list[str]:
    """The names of the tied pods with the most room for a new prefix
    (:func:`room`: vLLM's free blocks less the hot blocks
    this router sent there) when every tied pod has it, else the fewest resident blocks
    (all of them when a tied pod's count is unknown)."""
    rooms: list[float] = []
    for v in tied:
        f = room(v, hot.get(v.pod, 0))
        if f is None:
            break
        rooms.append(f)
    else:
        most = max(rooms)
        return [v.pod for v, r in zip(tied, rooms, strict=True) if r == most]
    least = None
    for v in tied:
        if v.resident_blocks is None:
            return [v.pod for v in tied]
        if least is None or v.resident_blocks < least:
            least = v.resident_blocks
    return [v.pod for v in tied if v.resident_blocks == least]
