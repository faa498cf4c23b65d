"""The write side of :class:`~scoring.index.memory.InMemoryIndex`: ``add``, ``remove``,
``clear_pod`` and the size cap's eviction, in :class:`IndexWrites`, its base class.

They keep the bit-mask tables and pod ids that ``InMemoryIndex.__init__`` creates; the
layout, the bound and the costs are described in :mod:`scoring.index.memory`.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["IndexWrites", "UnknownTierError", "bits"]

_CANON_MAX = 1 << 16  # distinct interned masks kept before the table is reset


class UnknownTierError(ValueError):
    """A tier name that is not one of the index's ``tiers``."""


def bits(mask: int) -> list[int]:
    """Positions of the set bits of a non-negative ``mask``, lowest first."""
    if mask.bit_count() > 16:  # dense: one pass over the binary string is cheaper
        return [i for i, c in enumerate(bin(mask)[:1:-1]) if c == "1"]
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


class IndexWrites:
    """The writes of :class:`~scoring.index.memory.InMemoryIndex` (see the module
    docstring); the state they work on is created by ``InMemoryIndex.__init__``."""

    tiers: tuple[str, ...]
    max_entries: int
    evicted: int
    _tier_ix: dict[str, int]
    _any: dict[int, int]
    _not_fast: dict[int, int]
    _slow: list[dict[int, int]]
    _extra: dict[tuple[int, int, int], int]
    _canon: dict[int, int]
    _pid: dict[str, int]
    _names: list[str | None]
    _free: list[int]
    _pod_n: list[int]
    _pid_gen: int
    _entries: int

    # -- bookkeeping -----------------------------------------------------------------

    def _tier(self, tier: str) -> int:
        try:
            return self._tier_ix[tier]
        except KeyError:
            raise UnknownTierError(
                f"unknown tier {tier!r}; this index has tiers {self.tiers}"
            ) from None

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
            self._pid_gen += 1
        return pid

    def _held_slow(self, key: int, bit: int) -> bool:
        """Whether the pod ``bit`` holds ``key`` in some tier slower than the fastest."""
        return any(s.get(key, 0) & bit for s in self._slow[1:])

    # -- writes ----------------------------------------------------------------------

    def add_sync(self, pod: str, keys: Sequence[int], tier: str = "GPU") -> None:
        """Count one more copy of each key on ``pod`` in ``tier`` (touches the keys)."""
        t = self._tier(tier)
        pid = self._intern(pod)
        bit = 1 << pid
        any_ = self._any
        pop = any_.pop
        extra = self._extra
        new_entries = 0
        new_pod = 0
        canon = self._canon
        if len(canon) > _CANON_MAX:
            canon.clear()
        intern = canon.setdefault
        if t == 0:
            not_fast = self._not_fast
            for k in keys:
                a = pop(k, 0)
                if not a & bit:
                    a |= bit
                    any_[k] = intern(a, a)
                    new_entries += 1
                    new_pod += 1
                    continue
                any_[k] = a
                nf = not_fast.get(k, 0) if not_fast else 0
                if nf & bit:  # held only in slower tiers until now
                    nf &= ~bit
                    if nf:
                        not_fast[k] = nf
                    else:
                        del not_fast[k]
                    new_pod += 1
                else:
                    ek = (k, pid, 0)
                    extra[ek] = extra.get(ek, 1) + 1
        else:
            slow = self._slow[t]
            not_fast = self._not_fast
            for k in keys:
                a = pop(k, 0)
                m = slow.get(k, 0)
                if m & bit:
                    ek = (k, pid, t)
                    extra[ek] = extra.get(ek, 1) + 1
                else:
                    slow[k] = m | bit
                    new_pod += 1
                    if not a & bit:
                        a |= bit
                        a = intern(a, a)
                        new_entries += 1
                        not_fast[k] = not_fast.get(k, 0) | bit
                any_[k] = a
        self._pod_n[pid] += new_pod
        self._entries += new_entries
        if self._entries > self.max_entries:
            self._evict()

    def _drop(self, key: int, pid: int, t: int) -> None:
        """Remove ``pod``'s membership of ``key`` in tier ``t`` whatever its count."""
        bit = 1 << pid
        a = self._any.get(key)
        if a is None or not a & bit:
            return
        if self._extra:
            self._extra.pop((key, pid, t), None)
        not_fast = self._not_fast
        if t == 0:
            nf = not_fast.get(key, 0)
            if nf & bit:
                return  # not held in the fastest tier
            self._pod_n[pid] -= 1
            if self._held_slow(key, bit):
                not_fast[key] = nf | bit
                return
        else:
            slow = self._slow[t]
            m = slow.get(key, 0)
            if not m & bit:
                return
            m &= ~bit
            if m:
                slow[key] = m
            else:
                del slow[key]
            self._pod_n[pid] -= 1
            nf = not_fast.get(key, 0)
            if not nf & bit or self._held_slow(key, bit):
                return  # still held in the fastest tier or another slow one
            nf &= ~bit
            if nf:
                not_fast[key] = nf
            else:
                del not_fast[key]
        a &= ~bit
        self._entries -= 1
        if a:
            self._any[key] = a
        else:
            del self._any[key]

    def remove_sync(self, pod: str, keys: Sequence[int], tier: str = "GPU") -> None:
        """Count one copy fewer of each key; unknown keys are ignored."""
        t = self._tier(tier)
        pid = self._pid.get(pod)
        if pid is None:
            return
        bit = 1 << pid
        any_ = self._any
        extra = self._extra
        # common case: one fastest-tier copy, no slower tiers anywhere
        fast_only = t == 0 and not self._not_fast and not extra and not self._extra_tiers_used()
        intern = self._canon.setdefault
        for k in keys:
            a = any_.get(k)
            if a is None or not a & bit:
                continue
            if fast_only:
                a &= ~bit
                self._entries -= 1
                self._pod_n[pid] -= 1
                if a:
                    any_[k] = intern(a, a)
                else:
                    del any_[k]
                continue
            if extra:
                ek = (k, pid, t)
                c = extra.get(ek)
                if c is not None:
                    if c > 2:
                        extra[ek] = c - 1
                    else:
                        del extra[ek]
                    continue
            self._drop(k, pid, t)

    def _extra_tiers_used(self) -> bool:
        return any(self._slow[1:])

    def clear_pod_sync(self, pod: str, tier: str | None = None) -> None:
        """Forget every entry of ``pod`` (only ``tier`` when given); O(keys)."""
        pid = self._pid.get(pod)
        if pid is None:
            return
        if tier is not None:
            t = self._tier(tier)
            bit = 1 << pid
            if t == 0:
                nf = self._not_fast
                held = [k for k, a in self._any.items() if a & bit and not nf.get(k, 0) & bit]
            else:
                held = [k for k, m in self._slow[t].items() if m & bit]
            for k in held:
                self._drop(k, pid, t)
            return
        bit = 1 << pid
        keep = ~bit
        any_ = self._any
        held = [k for k, a in any_.items() if a & bit]
        for k in held:
            a = any_[k] & keep
            if a:
                any_[k] = a
            else:
                del any_[k]
            for d in (self._not_fast, *self._slow[1:]):
                m = d.get(k)
                if m is not None and m & bit:
                    m &= keep
                    if m:
                        d[k] = m
                    else:
                        del d[k]
        if self._extra:
            for ek in [ek for ek in self._extra if ek[1] == pid]:
                del self._extra[ek]
        self._entries -= len(held)
        self._pod_n[pid] = 0
        del self._pid[pod]
        self._names[pid] = None
        self._free.append(pid)
        self._pid_gen += 1

    def _evict(self) -> None:
        """Drop least recently stored keys until entries <= 99% of ``max_entries``."""
        target = self.max_entries - max(1, self.max_entries // 100)
        need = self._entries - target
        victims: list[int] = []
        freed = 0
        any_ = self._any
        for k, a in any_.items():  # oldest first
            if freed >= need:
                break
            victims.append(k)
            freed += a.bit_count()
        for k in victims:
            a = any_.pop(k)
            nf = self._not_fast.pop(k, 0)
            for pid in bits(a):
                n = 0 if nf >> pid & 1 else 1
                self._pod_n[pid] -= n
            for s in self._slow[1:]:
                m = s.pop(k, 0)
                for pid in bits(m):
                    self._pod_n[pid] -= 1
            if self._extra:
                for pid in bits(a):
                    for t in range(len(self.tiers)):
                        self._extra.pop((k, pid, t), None)
        self._entries -= freed
        self.evicted += freed
