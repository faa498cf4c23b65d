"""``cost``'s room for a new prefix and its charge for evicting hot blocks
(scoring/policies/hot_set.py): cold cache is free room, what the router sent a pod
recently is not, and a miss that would push hot blocks out of a full cache pays for them."""

from __future__ import annotations

import random
from collections import Counter

from scoring.policies import PodView, RouteRequest, build_policy
from scoring.policies.cost import CostPolicy
from scoring.policies.hot_set import HotBlocks, evicted_hot, most_room, room
from tests.support.clock import ManualClock

BS = 16


def req(rid: str, keys: list[int]) -> RouteRequest:
    return RouteRequest(
        request_id=rid, model="m", prompt_tokens=len(keys) * BS, block_keys=keys, block_size=BS
    )


def policy(**params: object) -> tuple[CostPolicy, ManualClock]:
    p = build_policy("cost", params)
    assert isinstance(p, CostPolicy)
    clock = ManualClock(1000.0)
    p.clock = clock
    return p, clock


def test_a_pod_full_of_old_cache_no_request_holds_is_not_a_full_pod() -> None:
    """vLLM evicts cached blocks no running request holds when it needs room: free room
    is ``capacity * (1 - kv_usage)``, not ``capacity - resident``."""
    p, _ = policy()
    views = [
        PodView(pod="old-cache", resident_blocks=1_000, capacity_blocks=1_000, kv_usage=0.0),
        PodView(pod="busy", resident_blocks=100, capacity_blocks=1_000, kv_usage=0.5),
    ]
    assert {p.pick(req(f"id-{i}", [i]), views).pod for i in range(50)} == {"old-cache"}
    # without a usage the index's count is all there is: capacity - resident
    unscraped = [
        PodView(pod=v.pod, resident_blocks=v.resident_blocks, capacity_blocks=1_000) for v in views
    ]
    assert {p.pick(req(f"id-{i}", [i]), unscraped).pod for i in range(50)} == {"busy"}


def test_blocks_the_router_sent_a_pod_recently_are_not_room_for_a_new_prefix() -> None:
    p, _ = policy()
    views = [
        PodView(pod=f"p{i}", resident_blocks=0, capacity_blocks=100, kv_usage=0.0) for i in range(2)
    ]
    first = req("first", list(range(10)))
    p.on_routed(first, "p0")  # a conversation in progress: its next turn will reuse these
    assert p.hot_blocks("p0") == 10 and p.hot_blocks("p1") == 0
    chosen = Counter(p.pick(req(f"id-{i}", [1000 + i]), views).pod for i in range(50))
    assert chosen == Counter({"p1": 50})


def test_hot_blocks_go_cold_after_the_window() -> None:
    p, clock = policy(hot_window_s=300.0)
    p.on_routed(req("a", [1, 2, 3]), "p0")
    clock.now += 200
    p.on_routed(req("b", [1, 4]), "p0")  # block 1 routed again: hot from now
    assert p.hot_blocks("p0") == 4
    clock.now += 150  # 350 s after "a", 150 s after "b"
    assert p.hot_blocks("p0") == 2  # blocks 1 and 4
    clock.now += 200
    assert p.hot_blocks("p0") == 0


def test_a_miss_that_would_evict_hot_blocks_goes_where_the_cache_has_room() -> None:
    """p0 holds the request's first 2 blocks, but its cache (10 blocks) is full of hot
    blocks: the 4 it would compute push out 4 hot ones, a later miss each.  p1 computes
    all 6 and evicts nothing hot."""
    p, _ = policy()  # the charge is on by default (session 21)
    p.on_routed(req("warm", list(range(10))), "p0")
    views = [
        PodView(pod="p0", hits={"GPU": 2}, resident_blocks=10, capacity_blocks=10, kv_usage=0.0),
        PodView(pod="p1", resident_blocks=0, capacity_blocks=10, kv_usage=0.0),
    ]
    request = req("r", [0, 1, 100, 101, 102, 103])
    decision = p.pick(request, views)
    assert decision.pod == "p1"
    assert decision.detail["evicted_hot_blocks"] == {"p0": 4}
    # without the charge, or with hot tracking off, only the request's own prefill
    # counts: the hit wins
    uncharged, _ = policy(charge_hot_evictions=False)
    off, _ = policy(hot_window_s=0.0)
    for q in (uncharged, off):
        q.on_routed(req("warm", list(range(10))), "p0")
        assert q.pick(request, views).pod == "p0"
    assert off.hot_blocks("p0") == 0


def test_a_hot_set_that_fits_the_cache_costs_nothing() -> None:
    p, _ = policy(charge_hot_evictions=True)
    p.on_routed(req("warm", list(range(10))), "p0")
    views = [
        PodView(pod="p0", hits={"GPU": 2}, resident_blocks=10, capacity_blocks=100),
        PodView(pod="p1", resident_blocks=0, capacity_blocks=100),
    ]
    decision = p.pick(req("r", [0, 1, 100, 101, 102, 103]), views)
    assert decision.pod == "p0" and decision.detail["evicted_hot_blocks"] == {}


def test_evicted_hot_blocks_are_the_overflow_at_most_the_new_blocks() -> None:
    assert evicted_hot(hot=90, new=5, capacity=100) == 0
    assert evicted_hot(hot=98, new=5, capacity=100) == 3
    assert evicted_hot(hot=500, new=5, capacity=100) == 5  # thrashing: one per new block
    assert evicted_hot(hot=500, new=0, capacity=100) == 0
    assert evicted_hot(hot=500, new=5, capacity=None) == 0


def test_room_is_the_smaller_of_vllms_free_blocks_and_capacity_less_hot() -> None:
    view = PodView(pod="p", resident_blocks=80, capacity_blocks=100, kv_usage=0.25)
    assert room(view, hot=10) == 75.0  # running requests hold more than the hot set
    assert room(view, hot=40) == 60.0
    assert room(PodView(pod="p", resident_blocks=80), hot=10) is None  # capacity unknown


def test_the_tie_break_keeps_the_pods_with_the_most_room_else_the_most_cached() -> None:
    """``most_room`` (one pass, inlined for speed) against its definition: every tied
    pod's :func:`room` known, the pods with the largest; else the pods holding the most
    of the prompt (when one holds some), and among them the fewest resident blocks;
    else all of them.  Random views, with bogus usages (NaN, infinite, out of [0, 1]),
    pods with and without hot blocks, and with and without cached tokens."""
    rng = random.Random(7)
    usages = [None, 0.0, 0.3, 0.5, 1.0, 1.7, -0.2, float("nan"), float("inf")]
    for _ in range(1000):
        hot = HotBlocks(window_s=100.0)
        for i in range(4):
            hot.routed(f"p{i}", list(range(i * 1000, i * 1000 + 40 * i)), now=0.0)
        views = [
            PodView(
                pod=f"p{i}",
                kv_usage=rng.choice(usages),
                resident_blocks=rng.choice([None, 0, 30, 60]),
                capacity_blocks=rng.choice([None, 100, 100, 200]),
            )
            for i in range(rng.randint(2, 5))
        ]
        now = rng.choice([1.0, 150.0])  # the hot blocks within the window, or gone
        cached = rng.choice([None, {}, {v.pod: rng.choice([0, 0, 16, 32]) for v in views}])
        rooms = [room(v, hot.count(v.pod, now)) for v in views]
        if all(r is not None for r in rooms):
            most = max(r for r in rooms if r is not None)
            want = [v.pod for v, r in zip(views, rooms, strict=True) if r == most]
        else:
            holders = views
            if cached and max(cached.values()) > 0:
                top = max(cached.values())
                holders = [v for v in views if cached[v.pod] == top]
            if len(holders) == 1:
                want = [holders[0].pod]
            elif all(v.resident_blocks is not None for v in holders):
                least = min(v.resident_blocks for v in holders if v.resident_blocks is not None)
                want = [v.pod for v in holders if v.resident_blocks == least]
            else:
                want = [v.pod for v in holders]
        assert most_room(views, hot, now, cached) == want
        # the same with some of the hot counts read beforehand (cost's charge reads them)
        counted = {v.pod: hot.count(v.pod, now) for v in views if rng.random() < 0.5}
        assert most_room(views, hot, now, cached, counted) == want


def test_with_no_cache_size_known_a_repeated_prompt_stays_on_the_pod_that_holds_it() -> None:
    """Backends that report no cache size (no KV events, no vLLM metrics): a short
    prompt sent again and again ties on predicted TTFT everywhere (here: predictions
    within ``tie_epsilon_s``, as a prompt of a few tokens on fast pods is).  Nothing
    says where a copy would have room, so none is made: every request goes where the
    first went (its prefix in flight there), as a cache-aware router keeps a repeated
    prefix on one pod.  With the pods' sizes known, room decides as before."""
    keys = [11, 12]
    unsized = [PodView(pod=f"b{i}", resident_blocks=0) for i in range(4)]
    p, _ = policy(tie_epsilon_s=1.0)
    # nothing held: the ties spread (rendezvous hashing of the request id)
    assert len({p.pick(req(f"id-{i}", keys), unsized).pod for i in range(64)}) == 4
    picks = []
    for i in range(64):  # each routed and left in flight, as under a closed-loop client
        r = req(f"id-{i}", keys)
        picks.append(p.pick(r, unsized).pod)
        p.on_routed(r, picks[-1])
    assert set(picks) == {picks[0]}
    # sized pods: a tie goes where vLLM has the most free room, held prefix or not
    p, _ = policy(tie_epsilon_s=1.0)
    sized = [PodView(pod=f"b{i}", capacity_blocks=100, kv_usage=0.1 * (3 - i)) for i in range(4)]
    first = req("first", keys)
    p.on_routed(first, "b0")
    assert p.pick(req("again", keys), sized).pod == "b3"


def test_a_pods_remembered_keys_are_bounded_by_its_capacity() -> None:
    hot = HotBlocks(window_s=1e9, max_keys=100)
    hot.routed("p", list(range(250)), now=0.0)
    assert hot.count("p", now=1.0) == 100
    hot.routed("p", list(range(250)), now=0.0, capacity=40)
    assert hot.count("p", now=1.0) == 80  # past twice the cache a hot set says no more
    hot.forget("p")
    assert hot.count("p", now=1.0) == 0


def test_a_removed_pod_forgets_its_hot_blocks() -> None:
    p, _ = policy()
    p.on_routed(req("a", [1, 2, 3]), "p0")
    p.on_pod_removed("p0")
    assert p.hot_blocks("p0") == 0
