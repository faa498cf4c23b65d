"""The embedded block index: (pod, block key, tier) -> count, in one process.

Layout (chosen for a small footprint and a fast chain walk):

* Pods are interned as small integers ``pid`` and every set of pods is a Python int
  *bit mask* (bit ``pid`` set = the pod holds the block).
* ``_any[key]`` is the mask of pods holding ``key`` in *any* tier.  Its insertion order
  is the LRU order (an ``add`` moves the key to the end).
* ``_not_fast[key]`` is the mask of pods holding ``key`` only in slower tiers (not in the
  fastest tier, ``tiers[0]``); ``_slow[t][key]`` the mask of pods holding ``key`` in
  tier ``t >= 1``.  All three are empty on a GPU-only fleet, so the common entry costs
  one dict slot, one key int and one mask int.
* Equal masks are interned (one shared int object per distinct holder set, bounded by
  ``_CANON_MAX`` in :mod:`~scoring.index.memory_writes`): less memory per key, and the
  chain walk skips the AND when a block's holders are the very object of the previous
  block's.
* Counts above 1 (vLLM stores the same hash twice on one pod) live in a side table
  ``_extra[(key, pid, tier)] = count``; an entry with count 1 is just its bit.

``lookup`` walks the chain: ``alive_t`` starts as the candidate mask and becomes
``alive_t & cum_t(key_i)`` at block ``i``, where ``cum_t`` is the mask of pods holding
the key in tier ``t`` or a faster one.  A pod leaving ``alive_t`` at block ``i`` has
``hits[t] = i``; the walk stops at the first block no candidate still alive holds in any
tier.  Cost: one dict lookup and one mask AND per block (independent of the number of
pods), plus work per pod only where it drops out.

Bound: at most ``max_entries`` (key, pod) pairs.  When an ``add`` exceeds it, the least
recently *stored* keys are evicted whole (all their pods and tiers), down to
``max_entries`` minus 1% slack so eviction runs in batches.  Recency is the store order,
not the lookup order: the index mirrors the pods' caches through their events, so the
cap only bites when removals were missed (lost events, vanished pods) -- and those
stale entries are the oldest stored.  A lookup never writes.

``clear_pod`` scans the keyspace (O(keys); it runs on engine restarts and pod removal,
not on the request path); ``pod_entries`` is O(pods) from counters.

The writes (``add``, ``remove``, ``clear_pod``, the eviction) are
:class:`~scoring.index.memory_writes.IndexWrites`, the base of :class:`InMemoryIndex`.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from scoring.index.base import DEFAULT_TIERS, PodHits
from scoring.index.memory_writes import IndexWrites, UnknownTierError, bits

__all__ = ["InMemoryIndex", "UnknownTierError"]


class InMemoryIndex(IndexWrites):
    """Bounded in-process :class:`~scoring.index.base.BlockIndex`.

    The async methods satisfy the protocol; the ``*_sync`` twins do the work and are
    what the event applier and the offline replay call on their hot paths.
    """

    def __init__(self, max_entries: int = 10_000_000, tiers: Sequence[str] = DEFAULT_TIERS) -> None:
        if max_entries <= 0:
            raise ValueError(f"max_entries must be positive, got {max_entries}")
        if not tiers:
            raise ValueError("tiers must name at least one tier")
        if len(set(tiers)) != len(tiers):
            raise ValueError(f"tiers must be distinct, got {tuple(tiers)}")
        self.tiers: tuple[str, ...] = tuple(tiers)
        self.max_entries = max_entries
        self._tier_ix = {t: i for i, t in enumerate(self.tiers)}
        self._any: dict[int, int] = {}
        self._not_fast: dict[int, int] = {}
        self._slow: list[dict[int, int]] = [{} for _ in self.tiers]  # [0] unused
        self._extra: dict[tuple[int, int, int], int] = {}
        self._canon: dict[int, int] = {}
        self._pid: dict[str, int] = {}
        self._names: list[str | None] = []
        self._free: list[int] = []
        self._pod_n: list[int] = []  # distinct (key, tier) entries per pid
        self._pid_gen = 0  # bumped whenever a name <-> pid binding changes
        self._cand_cache: dict[tuple[str, ...] | frozenset[str], tuple[int, int]] = {}
        self._entries = 0  # distinct (key, pod) pairs
        self.evicted = 0  # (key, pod) pairs evicted by the size cap, ever

    # -- bookkeeping -----------------------------------------------------------------

    def __len__(self) -> int:
        """Number of distinct (key, pod) entries."""
        return self._entries

    def _mask_of(self, pods: Collection[str]) -> int:
        """The mask of the known pods among ``pods`` (memoized per candidate list: the
        router asks with the same fleet over and over)."""
        key = frozenset(pods) if isinstance(pods, (set, frozenset)) else tuple(pods)
        hit = self._cand_cache.get(key)
        if hit is not None and hit[0] == self._pid_gen:
            return hit[1]
        mask = 0
        pid = self._pid
        for p in key:
            i = pid.get(p)
            if i is not None:
                mask |= 1 << i
        if len(self._cand_cache) >= 1024:
            self._cand_cache.clear()
        self._cand_cache[key] = (self._pid_gen, mask)
        return mask

    # -- reads -----------------------------------------------------------------------

    def lookup_sync(
        self, keys: Sequence[int], pods: Collection[str] | None = None
    ) -> dict[str, PodHits]:
        """For each candidate pod holding ``keys[0]``: leading blocks per tier
        (cumulative: ``hits[t]`` counts blocks held in tier ``t`` or a faster one).
        Every tier of the index appears in each pod's hits."""
        if not keys:
            return {}
        first = self._any.get(keys[0])
        if first is None:
            return {}
        alive = first if pods is None else first & self._mask_of(pods)
        if not alive:
            return {}
        if self._not_fast:  # else every holder holds in the fastest tier: cum_t == any
            return self._lookup_tiers(keys, alive)
        drops: list[tuple[int, int]] = []
        i = 0
        last = first  # alive already includes block 0's holders
        for m in map(self._any.get, keys):
            if m is not last:  # interned: the same holders as the previous block
                if m is None:
                    break
                last = m
                a = alive & m
                if a != alive:
                    drops.append((alive & ~a, i))
                    alive = a
                    if not a:
                        break
            i += 1
        if alive:
            drops.append((alive, i))
        names = self._names
        tiers = self.tiers
        out: dict[str, PodHits] = {}
        for mask, n in drops:
            copy = dict.fromkeys(tiers, n).copy
            out.update({names[pid]: copy() for pid in bits(mask)})  # type: ignore[misc]
        return out

    def _lookup_tiers(self, keys: Sequence[int], cand: int) -> dict[str, PodHits]:
        """The general walk when some pod holds some block only in a slower tier."""
        n_tiers = len(self.tiers)
        any_get = self._any.get
        nf_get = self._not_fast.get
        slow_gets = [s.get for s in self._slow]
        alive = [cand] * n_tiers
        drops: list[list[tuple[int, int]]] = [[] for _ in range(n_tiers)]
        i = 0
        last = n_tiers - 1
        for k in keys:
            a = any_get(k)
            if a is None:
                break
            c = a & ~nf_get(k, 0)
            for t in range(n_tiers):
                if t:
                    c |= slow_gets[t](k, 0)
                al = alive[t]
                if al:
                    na = al & c
                    if na != al:
                        drops[t].append((al & ~na, i))
                        alive[t] = na
            if not alive[last]:
                break
            i += 1
        for t in range(n_tiers):
            if alive[t]:
                drops[t].append((alive[t], i))
        names = self._names
        tiers = self.tiers
        out: dict[str, PodHits] = {}
        for pid in bits(cand):
            out[names[pid]] = dict.fromkeys(tiers, 0)  # type: ignore[index]
        for t, tier in enumerate(tiers):
            for mask, n in drops[t]:
                for pid in bits(mask):
                    out[names[pid]][tier] = n  # type: ignore[index]
        return out

    def pod_entries_sync(self) -> dict[str, int]:
        """Distinct (key, tier) entries per pod (pods with none are omitted)."""
        return {
            name: n
            for name, n in zip(self._names, self._pod_n, strict=True)
            if name is not None and n > 0
        }

    # -- BlockIndex protocol ---------------------------------------------------------

    async def add(self, pod: str, keys: Sequence[int], tier: str = "GPU") -> None:
        self.add_sync(pod, keys, tier)

    async def remove(self, pod: str, keys: Sequence[int], tier: str = "GPU") -> None:
        self.remove_sync(pod, keys, tier)

    async def clear_pod(self, pod: str, tier: str | None = None) -> None:
        self.clear_pod_sync(pod, tier)

    async def lookup(
        self, keys: Sequence[int], pods: Collection[str] | None = None
    ) -> dict[str, PodHits]:
        return self.lookup_sync(keys, pods)

    async def pod_entries(self) -> dict[str, int]:
        return self.pod_entries_sync()

    async def close(self) -> None:
        return None
