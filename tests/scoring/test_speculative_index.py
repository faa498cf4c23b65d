"""The speculative side index: routed chains per pod, with a TTL, bounded, walked on from
where the real index stopped."""

from __future__ import annotations

import pytest

from scoring.index.speculative import SpeculativeIndex
from tests.support.clock import ManualClock


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1000.0)


def test_a_routed_chain_is_held_as_leading_blocks_of_its_pod(clock: ManualClock) -> None:
    idx = SpeculativeIndex(clock=clock)
    assert idx.add("a", [1, 2, 3], ttl_s=10) == 3
    assert idx.lookup([1, 2, 3, 4], ["a", "b"]) == {"a": 3}
    assert idx.lookup([1, 2, 9], ["a"]) == {"a": 2}
    assert idx.lookup([9, 1, 2], ["a"]) == {}
    assert idx.lookup([1, 2, 3], ["b"]) == {}  # not a candidate's entry


def test_the_walk_continues_from_the_real_index_hits(clock: ManualClock) -> None:
    idx = SpeculativeIndex(clock=clock)
    # the index shows blocks 0..1 on "a": only the tail needs entries
    assert idx.add("a", [1, 2, 3, 4], ttl_s=10, start=2) == 2
    assert idx.lookup([1, 2, 3, 4], ["a"]) == {}  # alone, block 0 is not held
    assert idx.lookup([1, 2, 3, 4], ["a"], starts={"a": 2}) == {"a": 4}
    # a pod whose index hits already cover what its entries hold is not extended
    assert idx.lookup([1, 2, 3, 4], ["a"], starts={"a": 4}) == {}


def test_pods_joining_at_different_positions_are_walked_in_one_pass(clock: ManualClock) -> None:
    idx = SpeculativeIndex(clock=clock)
    idx.add("a", [1, 2, 3, 4, 5], ttl_s=10)
    idx.add("b", [1, 2, 3, 4, 5, 6], ttl_s=10, start=3)
    idx.add("c", [1, 2], ttl_s=10)
    got = idx.lookup([1, 2, 3, 4, 5, 6], ["a", "b", "c"], starts={"b": 3, "c": 5})
    assert got == {"a": 5, "b": 6}


def test_entries_expire_after_their_ttl_and_a_rewrite_rearms_them(clock: ManualClock) -> None:
    idx = SpeculativeIndex(clock=clock)
    idx.add("a", [1, 2], ttl_s=10)
    clock.now += 6
    idx.add("a", [1], ttl_s=10)  # block 0 re-armed until +16, block 1 still until +10
    assert idx.stats.refreshed == 1
    clock.now += 5
    assert idx.lookup([1, 2], ["a"]) == {"a": 1}
    assert idx.stats.expired == 1
    clock.now += 6
    assert idx.lookup([1, 2], ["a"]) == {}
    assert len(idx) == 0 and idx.pod_entries() == {}


def test_two_ttls_expire_each_on_time(clock: ManualClock) -> None:
    idx = SpeculativeIndex(clock=clock)
    idx.add("a", [1, 2], ttl_s=120)
    idx.add("b", [1, 2], ttl_s=2)
    clock.now += 3
    assert idx.lookup([1, 2], ["a", "b"]) == {"a": 2}
    # a chain rewritten with the other TTL moves to it (one entry, not two)
    idx.add("a", [1, 2], ttl_s=2)
    assert len(idx) == 2
    clock.now += 3
    assert idx.lookup([1, 2], ["a"]) == {}


def test_confirmed_entries_leave_and_are_counted(clock: ManualClock) -> None:
    idx = SpeculativeIndex(clock=clock)
    idx.add("a", [1, 2, 3], ttl_s=10)
    assert idx.confirm("a", [2, 3, 99]) == 2
    assert idx.stats.confirmed == 2
    assert idx.lookup([1, 2, 3], ["a"]) == {"a": 1}
    assert idx.confirm("nobody", [1]) == 0


def test_dropped_entries_leave_for_one_pod_only(clock: ManualClock) -> None:
    idx = SpeculativeIndex(clock=clock)
    idx.add("a", [1, 2], ttl_s=10)
    idx.add("b", [1, 2], ttl_s=10)
    assert idx.drop("a", [2]) == 1
    assert idx.lookup([1, 2], ["a", "b"]) == {"a": 1, "b": 2}
    assert idx.drop_pod("b") == 2
    assert idx.lookup([1, 2], ["a", "b"]) == {"a": 1}
    assert idx.stats.dropped == 3
    assert idx.pod_entries() == {"a": 1}
    # the freed pod slot is reused cleanly
    idx.add("c", [1, 2], ttl_s=10)
    assert idx.lookup([1, 2], ["a", "b", "c"]) == {"a": 1, "c": 2}


def test_the_size_bound_evicts_the_entries_nearest_to_expiry(clock: ManualClock) -> None:
    idx = SpeculativeIndex(max_entries=4, clock=clock)
    idx.add("a", [1, 2, 3], ttl_s=10)
    clock.now += 1
    idx.add("b", [1, 2, 3], ttl_s=10)
    assert len(idx) == 4
    assert idx.stats.evicted == 2
    # a's oldest entries went: blocks 0 and 1
    assert idx.lookup([1, 2, 3], ["a", "b"]) == {"b": 3}
    assert idx.pod_entries() == {"a": 1, "b": 3}


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="max_entries"):
        SpeculativeIndex(max_entries=0)
    with pytest.raises(ValueError, match="ttl_s"):
        SpeculativeIndex().add("a", [1], ttl_s=0)
