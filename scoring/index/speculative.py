"""Speculative index entries: block chains the router *sent* to a pod, not (yet) announced
by the pod's KV events.

Where a pod's KV events cannot tell what its cache holds -- it publishes none (events
off), or the index lost its entries (a resync after a gap, a queue overflow, a decode
error; Redis data loss) and cache *hits* publish nothing, so a hot prefix is never
announced again -- the router remembers what it routed there.  Dynamo does the same
(``--no-router-kv-events``: an approximate indexer fed by routing decisions, block TTL
``--router-ttl-secs`` 120 s; ``--router-predicted-ttl-secs``: a predict-on-route side
index next to the event-fed one, merged into the device score by per-worker max), and so
does llm-d (``speculativeIndexing`` with ``speculativeTTL`` 2 s in its precise-prefix
producer; its approximate producer keeps a per-pod LRU sized by the pod's GPU blocks).

Semantics:

* An entry is a (pod, block key) pair with an expiry.  :meth:`SpeculativeIndex.add`
  writes ``keys[start:]`` for a pod (``start`` = the blocks the real index already shows
  on that pod, which need no entry) and re-arms the expiry of entries already there.
* :meth:`~SpeculativeIndex.lookup` continues each pod's chain walk where the real index
  stopped (``starts``): a pod that holds blocks ``0..s-1`` by the index and ``s..n-1``
  speculatively holds ``n`` leading blocks.  With ``starts`` all 0 this is Dynamo's
  "max(primary, side)"; continuing from the index's hits lets a write skip what the
  index already knows (most writes then write nothing).
* :meth:`~SpeculativeIndex.confirm` forgets entries the real index now holds (a later
  ``BlockStored``); :meth:`~SpeculativeIndex.drop` forgets entries that were wrong (a
  ``BlockRemoved``, no hit movement on the pod), :meth:`~SpeculativeIndex.drop_pod` all
  of a pod's (``AllBlocksCleared``, the pod left).
* Expiry is lazy: every write and lookup first pops the expired entries (one queue per
  TTL, oldest first: O(1) when nothing expired).  An expired entry is never returned.
* Bounded: at most ``max_entries`` pairs; past it the entries nearest to expiry go first
  (for one TTL that is the least recently written: an LRU), down to 1% below the bound
  so that eviction runs in batches.

Pure and in-process: no I/O, no clock of its own but ``clock``.  Each router replica
keeps its own (what it routed), like Dynamo's side index, which "can create temporary
frontend-to-frontend differences until the actual worker KV events arrive".
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass

_KEY_MASK = (1 << 64) - 1


@dataclass(slots=True)
class SpeculativeStats:
    """Counters of (pod, block) entries, ever."""

    written: int = 0  # new entries
    refreshed: int = 0  # entries whose expiry was re-armed by a later write
    confirmed: int = 0  # the real index stored them: no longer speculative
    dropped: int = 0  # found wrong (removed, cleared, no hit movement, pod gone)
    expired: int = 0
    evicted: int = 0  # the size bound

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def _bits(mask: int) -> list[int]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


class SpeculativeIndex:
    """(pod, block key) -> expiry, with a chain walk per pod (see the module doc)."""

    def __init__(
        self, max_entries: int = 1_000_000, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if max_entries <= 0:
            raise ValueError(f"max_entries must be positive, got {max_entries}")
        self.max_entries = max_entries
        self.clock = clock
        self.stats = SpeculativeStats()
        #: block key -> mask of the pods holding it speculatively (bit = pid)
        self._held: dict[int, int] = {}
        #: ttl -> {(pid << 64) | key: expiry}, oldest write first
        self._queues: dict[float, OrderedDict[int, float]] = {}
        self._pid: dict[str, int] = {}
        self._names: list[str | None] = []
        self._free: list[int] = []
        self._pod_n: list[int] = []
        self._entries = 0

    def __len__(self) -> int:
        return self._entries

    def has_entries(self, pod: str) -> bool:
        """Whether ``pod`` has entries, expired ones not yet popped included (O(1))."""
        pid = self._pid.get(pod)
        return pid is not None and self._pod_n[pid] > 0

    def holds(self, pod: str) -> bool:
        """Whether ``pod`` has any live entry."""
        pid = self._pid.get(pod)
        if pid is None or not self._pod_n[pid]:
            return False
        self.expire()
        return self._pod_n[pid] > 0

    def pod_entries(self) -> dict[str, int]:
        """Live entries per pod (pods with none omitted)."""
        self.expire()
        return {
            name: self._pod_n[pid]
            for name, pid in self._pid.items()
            if self._pod_n[pid] and name is not None
        }

    # -- writes ----------------------------------------------------------------------

    def _intern(self, pod: str) -> int:
        pid = self._pid.get(pod)
        if pid is None:
            if self._free:
                pid = self._free.pop()
                self._names[pid] = pod
            else:
                pid = len(self._names)
                self._names.append(pod)
                self._pod_n.append(0)
            self._pid[pod] = pid
        return pid

    def add(self, pod: str, keys: Sequence[int], ttl_s: float, start: int = 0) -> int:
        """Hold ``keys[start:]`` on ``pod`` for ``ttl_s`` seconds from now (re-arming
        entries already held); returns the number of new entries."""
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s}")
        if start >= len(keys):
            return 0
        now = self.clock()
        self._expire(now)
        pid = self._intern(pod)
        bit = 1 << pid
        high = pid << 64
        q = self._queues.get(ttl_s)
        if q is None:
            q = self._queues[ttl_s] = OrderedDict()
        others = [o for t, o in self._queues.items() if t != ttl_s and o]
        held = self._held
        held_get = held.get
        move = q.move_to_end
        expiry = now + ttl_s
        new = 0
        refreshed = 0
        for i in range(start, len(keys)):
            key = keys[i]
            ek = high | key
            if ek in q:
                move(ek)
                q[ek] = expiry
                refreshed += 1
                continue
            q[ek] = expiry
            if others and any(o.pop(ek, None) is not None for o in others):
                refreshed += 1  # it moved from another TTL's queue
                continue
            held[key] = held_get(key, 0) | bit
            new += 1
        self._pod_n[pid] += new
        self._entries += new
        self.stats.written += new
        self.stats.refreshed += refreshed
        if self._entries > self.max_entries:
            # down to 1% below the bound, so eviction runs in batches
            self._evict(self._entries - self.max_entries + self.max_entries // 100)
        return new

    def _unhold(self, ek: int) -> None:
        """Forget one entry already popped from its queue."""
        key = ek & _KEY_MASK
        pid = ek >> 64
        m = self._held.get(key, 0) & ~(1 << pid)
        if m:
            self._held[key] = m
        else:
            self._held.pop(key, None)
        self._pod_n[pid] -= 1
        self._entries -= 1

    def _forget(self, pod: str, keys: Sequence[int]) -> int:
        pid = self._pid.get(pod)
        if pid is None or not self._pod_n[pid]:
            return 0
        high = pid << 64
        clear = ~(1 << pid)
        queues = [q.pop for q in self._queues.values() if q]
        held = self._held
        n = 0
        for key in keys:
            ek = high | key
            for pop in queues:
                if pop(ek, None) is not None:
                    m = held[key] & clear
                    if m:
                        held[key] = m
                    else:
                        del held[key]
                    n += 1
                    break
        self._pod_n[pid] -= n
        self._entries -= n
        return n

    def confirm(self, pod: str, keys: Sequence[int]) -> int:
        """The real index now holds ``keys`` on ``pod``: their entries go (counted as
        confirmed); returns how many there were."""
        n = self._forget(pod, keys)
        self.stats.confirmed += n
        return n

    def drop(self, pod: str, keys: Sequence[int]) -> int:
        """``pod`` does not hold ``keys`` (evicted, or never had them): their entries go
        (counted as dropped); returns how many there were."""
        n = self._forget(pod, keys)
        self.stats.dropped += n
        return n

    def drop_pod(self, pod: str) -> int:
        """Every entry of ``pod`` goes (counted as dropped); the pod's name is released."""
        pid = self._pid.get(pod)
        if pid is None:
            return 0
        n = 0
        if self._pod_n[pid]:
            for q in self._queues.values():
                for ek in [ek for ek in q if ek >> 64 == pid]:
                    del q[ek]
                    self._unhold(ek)
                    n += 1
        self.stats.dropped += n
        del self._pid[pod]
        self._names[pid] = None
        self._free.append(pid)
        return n

    def expire(self) -> int:
        """Pop every expired entry; returns how many."""
        return self._expire(self.clock())

    def _expire(self, now: float) -> int:
        n = 0
        for q in self._queues.values():
            while q:
                ek, expiry = next(iter(q.items()))
                if expiry > now:
                    break
                q.popitem(last=False)
                self._unhold(ek)
                n += 1
        self.stats.expired += n
        return n

    def _evict(self, count: int) -> None:
        """Drop ``count`` entries, those nearest to expiry first."""
        held = self._held
        pod_n = self._pod_n
        n = 0
        while n < count:
            fronts = sorted(
                (next(iter(q.values())), i, q) for i, q in enumerate(self._queues.values()) if q
            )
            if not fronts:
                break
            q = fronts[0][2]
            # pop from the earliest queue until another queue's front comes first
            limit = fronts[1][0] if len(fronts) > 1 else float("inf")
            pop = q.popitem
            while n < count and q:
                ek, exp = pop(last=False)
                if exp > limit:
                    q[ek] = exp
                    q.move_to_end(ek, last=False)
                    break
                key = ek & _KEY_MASK
                pid = ek >> 64
                m = held.get(key, 0) & ~(1 << pid)
                if m:
                    held[key] = m
                else:
                    held.pop(key, None)
                pod_n[pid] -= 1
                n += 1
        self._entries -= n
        self.stats.evicted += n

    # -- reads -----------------------------------------------------------------------

    def lookup(
        self,
        keys: Sequence[int],
        pods: Collection[str],
        starts: Mapping[str, int] | None = None,
    ) -> dict[str, int]:
        """Per pod among ``pods`` whose speculative entries extend its chain: the leading
        blocks of ``keys`` it holds, counting blocks ``0..starts[pod]-1`` as held (the
        real index's hits) and continuing the walk from there.  Pods the entries do not
        extend are omitted."""
        if not self._entries or not keys:
            return {}
        self._expire(self.clock())
        n = len(keys)
        joins: list[tuple[int, int]] = []
        pid_of = self._pid
        pod_n = self._pod_n
        for name in pods:
            pid = pid_of.get(name)
            if pid is None or not pod_n[pid]:
                continue
            s = starts.get(name, 0) if starts else 0
            if s < n:
                joins.append((s, pid))
        if not joins:
            return {}
        joins.sort()
        start_of = {pid: s for s, pid in joins}
        names = self._names
        out: dict[str, int] = {}
        held_get = self._held.get
        alive = 0
        j = 0
        n_joins = len(joins)
        i = joins[0][0]
        while i < n:
            while j < n_joins and joins[j][0] <= i:
                alive |= 1 << joins[j][1]
                j += 1
            m = held_get(keys[i], 0)
            gone = alive & ~m
            if gone:
                for pid in _bits(gone):
                    if i > start_of[pid]:
                        out[names[pid] or ""] = i
                alive &= m
            if not alive:
                if j >= n_joins:
                    return out
                i = joins[j][0]
                continue
            i += 1
        for pid in _bits(alive):
            out[names[pid] or ""] = n
        return out
