"""An LRU prefix cache over block keys, as a vLLM pod keeps one.

Used by the offline replay (one per simulated pod) and by the simulated pod
(`kvroute sim`).  It keeps *prefix closure*: a block is cached only while its parent
is, like vLLM, which frees a finished request's blocks tail first so a chain shrinks
from its end.

The trick that gives closure for free: a chain is touched leaf first and root last,
so a parent is always at least as recent as any of its children, and evicting the
least recent block never removes a block whose child stays.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class PrefixCache:
    """Holds at most ``capacity_blocks`` block keys."""

    __slots__ = ("_lru", "_pins", "capacity_blocks")

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()
        #: key -> pin count; pinned keys are never evicted (a prefill pod's blocks held
        #: for a decode pod to pull, router.sim.disagg)
        self._pins: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._lru)

    def __contains__(self, key: object) -> bool:
        return key in self._lru

    def match(self, keys: Sequence[int]) -> int:
        """How many leading blocks of ``keys`` are cached (does not touch them)."""
        lru = self._lru
        n = 0
        for k in keys:
            if k not in lru:
                break
            n += 1
        return n

    def insert(self, keys: Sequence[int]) -> tuple[list[int], list[int]]:
        """Cache the chain ``keys`` (touching the cached part).

        Returns ``(stored, evicted)``: keys newly added and keys evicted to make room
        (a key can be in both when the chain itself does not fit).
        """
        lru = self._lru
        stored: list[int] = []
        move = lru.move_to_end
        for k in reversed(keys):
            if k in lru:
                move(k)
            else:
                lru[k] = None
                stored.append(k)
        stored.reverse()
        evicted: list[int] = []
        over = len(lru) - self.capacity_blocks
        pins = self._pins
        kept: list[int] = []
        while over > 0 and lru:
            k = lru.popitem(last=False)[0]
            if k in pins:
                kept.append(k)
                continue
            evicted.append(k)
            over -= 1
        for k in reversed(kept):  # pinned keys go back where they were, oldest first
            lru[k] = None
            lru.move_to_end(k, last=False)
        return stored, evicted

    def pin(self, keys: Sequence[int]) -> list[int]:
        """Pin the cached ones of ``keys`` (counted); returns those pinned."""
        pinned = [k for k in keys if k in self._lru]
        for k in pinned:
            self._pins[k] = self._pins.get(k, 0) + 1
        return pinned

    def unpin(self, keys: Sequence[int]) -> None:
        """Undo one :meth:`pin` of each of ``keys``: they become evictable again."""
        for k in keys:
            n = self._pins.get(k, 0) - 1
            if n > 0:
                self._pins[k] = n
            else:
                self._pins.pop(k, None)

    @property
    def pinned_blocks(self) -> int:
        return len(self._pins)

    def clear(self) -> list[int]:
        """Drop everything; returns the keys dropped."""
        keys = list(self._lru)
        self._lru.clear()
        self._pins.clear()
        return keys
