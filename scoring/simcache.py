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

    __slots__ = ("_lru", "capacity_blocks")

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()

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
        while over > 0:
            evicted.append(lru.popitem(last=False)[0])
            over -= 1
        return stored, evicted

    def clear(self) -> list[int]:
        """Drop everything; returns the keys dropped."""
        keys = list(self._lru)
        self._lru.clear()
        return keys
