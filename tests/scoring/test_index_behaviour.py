"""The behaviour every BlockIndex backend must have (scoring/index/base.py).

Runs once per backend through the parametrized ``index`` fixture (conftest.py):
``memory`` always, ``redis`` against a real server.  Only the protocol is used.
"""

from __future__ import annotations

from scoring.index.base import BlockIndex

K = [1001 + i for i in range(12)]  # a chain of block keys


def full(n: int, tiers: tuple[str, ...]) -> dict[str, int]:
    return dict.fromkeys(tiers, n)


async def test_an_empty_index_finds_nothing(index: BlockIndex) -> None:
    assert await index.lookup(K) == {}
    assert await index.lookup([]) == {}
    assert await index.pod_entries() == {}


async def test_lookup_counts_leading_blocks_of_the_chain(index: BlockIndex) -> None:
    await index.add("a", K[:5])
    assert await index.lookup(K) == {"a": full(5, index.tiers)}


async def test_the_walk_stops_at_the_first_block_no_pod_holds(index: BlockIndex) -> None:
    await index.add("a", K[:3] + K[4:8])  # hole at block 3
    assert await index.lookup(K) == {"a": full(3, index.tiers)}


async def test_a_pod_missing_block_zero_gets_nothing_even_if_it_holds_later_blocks(
    index: BlockIndex,
) -> None:
    await index.add("a", K[:4])
    await index.add("b", K[1:6])
    assert await index.lookup(K) == {"a": full(4, index.tiers)}


async def test_each_pod_gets_its_own_prefix_length(index: BlockIndex) -> None:
    await index.add("a", K[:2])
    await index.add("b", K[:7])
    await index.add("c", K)
    assert await index.lookup(K) == {
        "a": full(2, index.tiers),
        "b": full(7, index.tiers),
        "c": full(12, index.tiers),
    }


async def test_a_pod_dropping_out_does_not_stop_the_others(index: BlockIndex) -> None:
    await index.add("a", K[:2] + K[3:10])  # a has a hole at 2
    await index.add("b", K[:10])
    hits = await index.lookup(K)
    assert hits == {"a": full(2, index.tiers), "b": full(10, index.tiers)}


async def test_a_block_stored_twice_needs_two_removals(index: BlockIndex) -> None:
    await index.add("a", K[:4])
    await index.add("a", K[:4])
    await index.remove("a", K[:4])
    assert await index.lookup(K) == {"a": full(4, index.tiers)}
    await index.remove("a", K[:4])
    assert await index.lookup(K) == {}


async def test_removing_a_middle_block_shortens_the_prefix(index: BlockIndex) -> None:
    await index.add("a", K[:6])
    await index.remove("a", [K[2]])
    assert await index.lookup(K) == {"a": full(2, index.tiers)}


async def test_removing_unknown_keys_or_pods_is_ignored(index: BlockIndex) -> None:
    await index.add("a", K[:3])
    await index.remove("a", [99, 98])
    await index.remove("nobody", K[:3])
    await index.remove("a", K[:3], tier="CPU")  # never stored in CPU
    assert await index.lookup(K) == {"a": full(3, index.tiers)}


async def test_removal_is_per_pod(index: BlockIndex) -> None:
    await index.add("a", K[:3])
    await index.add("b", K[:3])
    await index.remove("a", K[:3])
    assert await index.lookup(K) == {"b": full(3, index.tiers)}


async def test_hits_are_cumulative_over_faster_tiers(index: BlockIndex) -> None:
    assert index.tiers[:2] == ("GPU", "CPU")
    await index.add("a", K[:3], tier="GPU")
    await index.add("a", K[3:7], tier="CPU")
    hits = await index.lookup(K)
    assert hits["a"]["GPU"] == 3
    assert hits["a"]["CPU"] == 7
    assert all(hits["a"][t] == 7 for t in index.tiers[2:])


async def test_a_block_in_gpu_and_cpu_counts_for_both(index: BlockIndex) -> None:
    await index.add("a", K[:5], tier="GPU")
    await index.add("a", K[:8], tier="CPU")
    assert (await index.lookup(K))["a"] == {
        "GPU": 5,
        "CPU": 8,
        **{t: 8 for t in index.tiers[2:]},
    }
    await index.remove("a", K[:5], tier="GPU")  # GPU copies evicted, CPU copies stay
    assert (await index.lookup(K))["a"] == {"GPU": 0, **{t: 8 for t in index.tiers[1:]}}


async def test_a_cpu_only_pod_is_reported_with_zero_gpu_hits(index: BlockIndex) -> None:
    await index.add("a", K[:4], tier="GPU")
    await index.add("b", K[:6], tier="CPU")
    hits = await index.lookup(K)
    assert hits["a"] == full(4, index.tiers)
    assert hits["b"] == {"GPU": 0, **{t: 6 for t in index.tiers[1:]}}


async def test_a_gpu_hole_filled_by_cpu_stops_gpu_hits_only(index: BlockIndex) -> None:
    await index.add("a", K[:2] + K[3:9], tier="GPU")
    await index.add("a", [K[2]], tier="CPU")
    assert (await index.lookup(K))["a"] == {"GPU": 2, **{t: 9 for t in index.tiers[1:]}}


async def test_candidates_restrict_the_answer(index: BlockIndex) -> None:
    await index.add("a", K[:3])
    await index.add("b", K[:9])
    assert await index.lookup(K, pods=["a"]) == {"a": full(3, index.tiers)}
    assert await index.lookup(K, pods={"a", "zz"}) == {"a": full(3, index.tiers)}
    assert await index.lookup(K, pods=[]) == {}
    assert await index.lookup(K, pods=["zz"]) == {}


async def test_the_walk_ignores_blocks_held_only_by_non_candidates(index: BlockIndex) -> None:
    await index.add("a", K[:3])
    await index.add("b", K[:9])
    # b holds block 3 but is not a candidate: a's prefix still ends at 3
    assert await index.lookup(K, pods=["a"]) == {"a": full(3, index.tiers)}


async def test_clear_pod_forgets_every_tier_of_that_pod_only(index: BlockIndex) -> None:
    await index.add("a", K[:4], tier="GPU")
    await index.add("a", K[:6], tier="CPU")
    await index.add("b", K[:5])
    await index.clear_pod("a")
    assert await index.lookup(K) == {"b": full(5, index.tiers)}
    assert await index.pod_entries() == {"b": 5}


async def test_clear_pod_of_one_tier_keeps_the_others(index: BlockIndex) -> None:
    await index.add("a", K[:4], tier="GPU")
    await index.add("a", K[:6], tier="CPU")
    await index.clear_pod("a", tier="GPU")
    assert (await index.lookup(K))["a"] == {"GPU": 0, **{t: 6 for t in index.tiers[1:]}}
    await index.clear_pod("a", tier="CPU")
    assert await index.lookup(K) == {}


async def test_clear_pod_forgets_counted_copies(index: BlockIndex) -> None:
    await index.add("a", K[:3])
    await index.add("a", K[:3])
    await index.clear_pod("a")
    await index.add("a", K[:3])
    await index.remove("a", K[:3])  # one copy now, so one removal empties it
    assert await index.lookup(K) == {}


async def test_a_cleared_pod_can_store_again(index: BlockIndex) -> None:
    await index.add("a", K[:3])
    await index.clear_pod("a")
    await index.add("a", K[:2])
    assert await index.lookup(K) == {"a": full(2, index.tiers)}


async def test_pod_entries_counts_distinct_key_tier_pairs(index: BlockIndex) -> None:
    await index.add("a", K[:4])
    await index.add("a", K[:4])  # a second copy is not a new entry
    await index.add("a", K[:2], tier="CPU")
    await index.add("b", K[:1])
    assert await index.pod_entries() == {"a": 6, "b": 1}
    await index.remove("a", K[:4])
    assert await index.pod_entries() == {"a": 6, "b": 1}  # one copy left of each
    await index.remove("a", K[:4])
    assert await index.pod_entries() == {"a": 2, "b": 1}


async def test_many_pods_each_get_their_prefix(index: BlockIndex) -> None:
    pods = [f"pod-{i:03d}" for i in range(200)]
    for i, p in enumerate(pods):
        await index.add(p, K[: 1 + i % len(K)])
    hits = await index.lookup(K)
    assert hits == {p: full(1 + i % len(K), index.tiers) for i, p in enumerate(pods)}
    some = pods[::17]
    assert set(await index.lookup(K, pods=some)) == set(some)


async def test_long_chains_are_walked_to_the_end(index: BlockIndex) -> None:
    chain = list(range(10_000, 12_048))
    await index.add("a", chain)
    await index.add("b", chain[:1500])
    assert await index.lookup(chain) == {
        "a": full(2048, index.tiers),
        "b": full(1500, index.tiers),
    }


# -- InMemoryIndex specifics: the size cap, the sync fast path, bad input -------------

import pytest  # noqa: E402

from scoring.index.memory import InMemoryIndex, UnknownTierError  # noqa: E402


def test_memory_index_evicts_least_recently_stored_keys_beyond_max_entries() -> None:
    idx = InMemoryIndex(max_entries=100)
    idx.add_sync("a", list(range(60)))
    idx.add_sync("b", list(range(30)))  # 90 (key, pod) entries; touches keys 0..29
    idx.add_sync("a", list(range(1000, 1020)))  # 110 > 100: oldest keys (30..) go first
    assert len(idx) <= 100
    assert idx.evicted >= 10
    assert idx.lookup_sync(list(range(1000, 1020))) == {"a": dict.fromkeys(idx.tiers, 20)}
    assert idx.lookup_sync([30]) == {}  # stored once, long ago: evicted
    assert set(idx.lookup_sync([0])) == {"a", "b"}  # re-stored by b: kept
    assert sum(idx.pod_entries_sync().values()) == len(idx)


def test_memory_index_re_storing_a_key_protects_it_from_eviction() -> None:
    idx = InMemoryIndex(max_entries=100)
    idx.add_sync("a", list(range(90)))
    idx.add_sync("a", [0])  # touch key 0: now the most recent
    idx.add_sync("a", list(range(500, 520)))
    assert idx.lookup_sync([0]) == {"a": dict.fromkeys(idx.tiers, 1)}
    assert idx.lookup_sync([1]) == {}


def test_memory_index_counts_key_pod_pairs_not_keys() -> None:
    idx = InMemoryIndex()
    idx.add_sync("a", [1, 2])
    idx.add_sync("b", [1])
    idx.add_sync("a", [1], tier="CPU")  # same (key, pod): not a new entry
    assert len(idx) == 3


def test_memory_index_rejects_an_unknown_tier_by_name() -> None:
    idx = InMemoryIndex()
    with pytest.raises(UnknownTierError, match="'NVME'"):
        idx.add_sync("a", [1], tier="NVME")
    with pytest.raises(ValueError, match="max_entries"):
        InMemoryIndex(max_entries=0)


def test_memory_index_reuses_the_slot_of_a_cleared_pod_without_leaking_its_blocks() -> None:
    idx = InMemoryIndex()
    idx.add_sync("old", [1, 2, 3])
    idx.clear_pod_sync("old")
    idx.add_sync("new", [1])  # takes over the old pod's bit
    assert idx.lookup_sync([1, 2, 3]) == {"new": dict.fromkeys(idx.tiers, 1)}
    assert idx.pod_entries_sync() == {"new": 1}


def test_memory_index_sync_and_async_views_agree() -> None:
    idx = InMemoryIndex()
    idx.add_sync("a", K[:3])
    assert idx.lookup_sync(K) == {"a": dict.fromkeys(idx.tiers, 3)}
    assert isinstance(idx, BlockIndex)


def reference_lookup(
    counts: dict[tuple[str, int, str], int],
    tiers: tuple[str, ...],
    keys: list[int],
    pods: set[str] | None,
) -> dict[str, dict[str, int]]:
    """The semantics of scoring/index/base.py, computed the slow and obvious way."""
    holders = {p for (p, _k, _t), c in counts.items() if c > 0}
    if pods is not None:
        holders &= pods
    out: dict[str, dict[str, int]] = {}
    for p in holders:
        hits = {}
        for ti, t in enumerate(tiers):
            n = 0
            while n < len(keys) and any(
                counts.get((p, keys[n], u), 0) > 0 for u in tiers[: ti + 1]
            ):
                n += 1
            hits[t] = n
        if hits[tiers[-1]] > 0:
            out[p] = hits
    # the walk stops at the first block no candidate still on the chain holds
    return out


def test_memory_index_matches_a_reference_model_under_random_operations() -> None:
    import random

    rng = random.Random(20261130)
    idx = InMemoryIndex()
    counts: dict[tuple[str, int, str], int] = {}
    pods = [f"p{i}" for i in range(7)]
    universe = list(range(1, 25))
    for step in range(1200):
        op = rng.random()
        pod = rng.choice(pods)
        tier = rng.choice(idx.tiers[:2]) if rng.random() < 0.8 else idx.tiers[2]
        ks = rng.sample(universe, rng.randint(1, 6))
        if op < 0.5:
            idx.add_sync(pod, ks, tier)
            for k in ks:
                counts[(pod, k, tier)] = counts.get((pod, k, tier), 0) + 1
        elif op < 0.9:
            idx.remove_sync(pod, ks, tier)
            for k in ks:
                if counts.get((pod, k, tier), 0) > 0:
                    counts[(pod, k, tier)] -= 1
        elif op < 0.95:
            idx.clear_pod_sync(pod, tier)
            for key in [key for key in counts if key[0] == pod and key[2] == tier]:
                counts[key] = 0
        else:
            idx.clear_pod_sync(pod)
            for key in [key for key in counts if key[0] == pod]:
                counts[key] = 0
        chain = universe[: rng.randint(1, len(universe))]
        cand = set(rng.sample(pods, 3)) if rng.random() < 0.3 else None
        assert idx.lookup_sync(chain, cand) == reference_lookup(counts, idx.tiers, chain, cand), (
            step
        )
        entries: dict[str, int] = {}
        for (p, _k, _t), c in counts.items():
            if c > 0:
                entries[p] = entries.get(p, 0) + 1
        assert idx.pod_entries_sync() == entries, step
        assert len(idx) == len({(p, k) for (p, k, _t), c in counts.items() if c > 0}), step


def test_memory_index_candidate_lists_see_pods_that_arrive_or_leave_later() -> None:
    idx = InMemoryIndex()
    cands = ["a", "late"]
    idx.add_sync("a", [1])
    assert set(idx.lookup_sync([1], cands)) == {"a"}
    idx.add_sync("late", [1])  # a pod unknown when the candidate list was first seen
    assert set(idx.lookup_sync([1], cands)) == {"a", "late"}
    idx.clear_pod_sync("a")
    idx.add_sync("other", [1])  # takes over a's freed slot: must not count as "a"
    assert set(idx.lookup_sync([1], cands)) == {"late"}
    assert set(idx.lookup_sync([1], {"other"})) == {"other"}
