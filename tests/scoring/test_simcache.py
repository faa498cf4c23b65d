"""The LRU prefix cache's pins: a pinned chain survives any eviction pressure until
unpinned, and eviction around it keeps LRU order and prefix closure."""

from __future__ import annotations

from scoring.simcache import PrefixCache


def test_pinned_blocks_are_never_evicted_and_others_go_oldest_first() -> None:
    cache = PrefixCache(4)
    cache.insert([1, 2])
    assert cache.pin([1, 2, 99]) == [1, 2]  # only cached keys are pinned
    cache.insert([10, 11])
    _, evicted = cache.insert([20, 21])
    assert evicted == [11, 10]  # a chain goes tail first
    assert cache.match([1, 2]) == 2 and cache.pinned_blocks == 2


def test_unpinned_blocks_become_evictable_again_once_every_pin_is_undone() -> None:
    cache = PrefixCache(2)
    cache.insert([1, 2])
    cache.pin([1, 2])
    cache.pin([1, 2])
    cache.unpin([1, 2])
    # still pinned once: a chain that does not fit beside them is what goes
    assert cache.insert([5, 6])[1] == [6, 5]
    cache.unpin([1, 2])
    _, evicted = cache.insert([7])
    assert evicted == [2]  # the chain shrinks from its tail
    assert cache.match([1, 2]) == 1
    assert cache.pinned_blocks == 0


def test_clear_drops_pins_too() -> None:
    cache = PrefixCache(2)
    cache.insert([1])
    cache.pin([1])
    cache.clear()
    assert cache.pinned_blocks == 0 and len(cache) == 0
