"""Routing policies: behaviour of each policy behind the one Policy interface."""

from __future__ import annotations

from collections import Counter

import pytest

from scoring.policies import PodView, RouteRequest, available_policies, build_policy
from scoring.policies.base import NoCandidatesError
from scoring.policies.cost import CostParams, CostPolicy, predict_ttft
from scoring.policies.registry import PolicyConfigError

BS = 16


def req(
    rid: str = "r",
    keys: list[int] | None = None,
    prompt: int | None = None,
    session: str | None = None,
) -> RouteRequest:
    keys = keys if keys is not None else []
    return RouteRequest(
        request_id=rid,
        model="m",
        prompt_tokens=prompt if prompt is not None else max(1, len(keys) * BS),
        block_keys=keys,
        block_size=BS,
        session=session,
    )


def pods(n: int, **kw: object) -> list[PodView]:
    return [PodView(pod=f"p{i}", **kw) for i in range(n)]  # type: ignore[arg-type]


# --- construction -------------------------------------------------------------------


def test_every_registered_policy_builds_with_defaults_and_has_its_name() -> None:
    for name in available_policies():
        assert build_policy(name).name == name


@pytest.mark.parametrize(
    "name", ["round_robin", "least_load", "session", "approx_prefix", "precise_prefix", "cost"]
)
def test_unknown_parameter_is_rejected_naming_it(name: str) -> None:
    with pytest.raises(PolicyConfigError, match="bogus_knob"):
        build_policy(name, {"bogus_knob": 1})


def test_invalid_parameter_value_is_rejected_naming_it() -> None:
    with pytest.raises(PolicyConfigError, match="prefill_rate_tokens_per_s"):
        build_policy("cost", {"prefill_rate_tokens_per_s": 0})
    with pytest.raises(PolicyConfigError, match="load_factor"):
        build_policy("session", {"load_factor": 0.5})
    with pytest.raises(PolicyConfigError, match="tier_weights"):
        build_policy("precise_prefix", {"tier_weights": {"GPU": 2.0}})


@pytest.mark.parametrize(
    "name", ["round_robin", "least_load", "session", "approx_prefix", "precise_prefix", "cost"]
)
def test_picking_among_no_pods_is_an_error(name: str) -> None:
    with pytest.raises(NoCandidatesError):
        build_policy(name).pick(req(), [])


# --- round_robin / least_load -------------------------------------------------------


def test_round_robin_cycles_through_candidates_in_order() -> None:
    policy = build_policy("round_robin")
    chosen = [policy.pick(req(str(i)), pods(3)).pod for i in range(6)]
    assert chosen == ["p0", "p1", "p2", "p0", "p1", "p2"]


def test_least_load_picks_fewest_outstanding_prefill_tokens() -> None:
    views = [
        PodView("a", outstanding_prefill_tokens=900, inflight=1),
        PodView("b", outstanding_prefill_tokens=100, inflight=5),
        PodView("c", outstanding_prefill_tokens=500, inflight=0),
    ]
    assert build_policy("least_load").pick(req(), views).pod == "b"
    assert build_policy("least_load", {"metric": "inflight"}).pick(req(), views).pod == "c"


def test_least_load_breaks_ties_at_random_not_toward_the_first_pod() -> None:
    policy = build_policy("least_load")
    counts = Counter(policy.pick(req(str(i)), pods(4)).pod for i in range(400))
    assert set(counts) == {"p0", "p1", "p2", "p3"}
    assert max(counts.values()) < 160  # uniform would be 100 each


# --- session ------------------------------------------------------------------------


def test_session_keeps_a_session_on_one_pod() -> None:
    policy = build_policy("session")
    chosen = {policy.pick(req(str(i), session="user-42"), pods(8)).pod for i in range(20)}
    assert len(chosen) == 1


def test_session_spreads_different_sessions_over_the_fleet() -> None:
    policy = build_policy("session")
    counts = Counter(policy.pick(req(session=f"s{i}"), pods(8)).pod for i in range(800))
    assert len(counts) == 8
    assert max(counts.values()) < 2.0 * 100


def test_session_moves_off_a_pod_over_the_load_bound() -> None:
    policy = build_policy("session", {"load_factor": 1.25})
    home = policy.pick(req(session="s"), pods(4)).pod
    # home pod holds 10 in-flight requests, the others none: bound = ceil(1.25*11/4) = 4
    views = [PodView(f"p{i}", inflight=10 if f"p{i}" == home else 0) for i in range(4)]
    decision = policy.pick(req(session="s"), views)
    assert decision.pod != home
    assert home in decision.detail["skipped_overloaded"]


def test_session_removing_a_pod_only_moves_that_pods_sessions() -> None:
    policy = build_policy("session")
    before = {f"s{i}": policy.pick(req(session=f"s{i}"), pods(8)).pod for i in range(400)}
    after = {f"s{i}": policy.pick(req(session=f"s{i}"), pods(7)).pod for i in range(400)}
    moved = [s for s in before if before[s] != after[s]]
    assert moved  # p7's sessions had to go somewhere
    assert all(before[s] == "p7" for s in moved)


def test_session_without_session_id_falls_back_to_least_load() -> None:
    views = [
        PodView("a", outstanding_prefill_tokens=50),
        PodView("b", outstanding_prefill_tokens=5),
    ]
    decision = build_policy("session").pick(req(), views)
    assert decision.pod == "b"
    assert "least_load" in decision.detail["fallback"]


# --- approx_prefix ------------------------------------------------------------------


def test_approx_prefix_follows_the_prefix_it_routed_before() -> None:
    policy = build_policy("approx_prefix")
    first = req("1", keys=[1, 2, 3, 4])
    pod = policy.pick(first, pods(4)).pod
    policy.on_routed(first, pod)
    follow_up = req("2", keys=[1, 2, 3, 4, 5, 6])  # 4/6 matched > 0.3
    for _ in range(5):
        assert policy.pick(follow_up, pods(4)).pod == pod


def test_approx_prefix_low_match_goes_to_the_smallest_tree() -> None:
    policy = build_policy("approx_prefix")
    policy.on_routed(req("a", keys=[10, 11, 12]), "p0")
    policy.on_routed(req("b", keys=[20, 21]), "p1")
    policy.on_routed(req("c", keys=[30]), "p2")
    decision = policy.pick(req("d", keys=[10, 99, 98, 97]), pods(3))  # 1/4 < 0.3
    assert decision.pod == "p2"
    assert decision.detail["reason"] == "low match: smallest tree"


def test_approx_prefix_under_imbalance_takes_the_shortest_queue() -> None:
    policy = build_policy("approx_prefix")
    policy.on_routed(req("a", keys=[1, 2, 3]), "p0")
    views = [PodView("p0", inflight=200), PodView("p1", inflight=100), PodView("p2", inflight=3)]
    decision = policy.pick(req("b", keys=[1, 2, 3]), views)  # 200-3 > 64 and 200 > 1.5*3
    assert decision.pod == "p2"
    assert decision.detail["imbalanced"] is True


def test_approx_prefix_tree_is_bounded() -> None:
    policy = build_policy("approx_prefix", {"capacity_tokens_per_pod": 10 * BS})
    for i in range(50):
        policy.on_routed(req(str(i), keys=[i * 100 + j for j in range(5)]), "p0")
    assert policy.tree_blocks("p0") == 10  # type: ignore[attr-defined]


# --- precise_prefix -----------------------------------------------------------------


def test_precise_prefix_prefers_the_longest_cached_prefix() -> None:
    views = [PodView("a", hits={"GPU": 2}), PodView("b", hits={"GPU": 9}), PodView("c")]
    assert build_policy("precise_prefix").pick(req(keys=list(range(10))), views).pod == "b"


def test_precise_prefix_weighs_cpu_blocks_at_0_8() -> None:
    # a: 10 GPU blocks = 10.0; b: 11 blocks only in CPU = 8.8
    views = [PodView("a", hits={"GPU": 10, "CPU": 10}), PodView("b", hits={"GPU": 0, "CPU": 11})]
    decision = build_policy("precise_prefix").pick(req(keys=list(range(12))), views)
    assert decision.pod == "a"
    assert decision.detail["prefix"] == {"a": 1.0, "b": 0.0}


def test_precise_prefix_uses_queue_when_prefixes_are_equal() -> None:
    views = [
        PodView("a", hits={"GPU": 4}, waiting=5, kv_usage=0.5),
        PodView("b", hits={"GPU": 4}, waiting=0, kv_usage=0.5),
    ]
    assert build_policy("precise_prefix").pick(req(keys=[1, 2, 3, 4]), views).pod == "b"


# --- cost ---------------------------------------------------------------------------


def test_cost_predicts_queue_plus_uncached_prefill_plus_cpu_transfer() -> None:
    p = CostParams(
        prefill_rate_tokens_per_s=1000.0,
        tier_load_rates_tokens_per_s={"CPU": 4000.0},
        miss_weight=1.0,
    )
    r = req(keys=list(range(10)), prompt=160)
    pod = PodView("a", hits={"GPU": 2, "CPU": 6}, outstanding_prefill_tokens=500)
    ttft, cached = predict_ttft(r, pod, p, queued_tokens=500)
    # queue 500/1000 + uncached (160-96)/1000 + CPU-only (96-32)/4000
    assert cached == 96
    assert ttft == pytest.approx(0.5 + 0.064 + 0.016)


@pytest.mark.parametrize("unit", ["request", "prompt"])
@pytest.mark.parametrize("seed", range(6))
def test_cost_pick_scores_every_pod_with_the_documented_predict_ttft(seed: int, unit: str) -> None:
    """pick computes the prediction inline (it runs on every request); its scores must
    stay exactly predict_ttft with the queue, in-flight prefixes and backlog-adjusted
    miss weight the policy itself reports, whatever has been routed before."""
    import random

    rng = random.Random(seed)
    policy = build_policy(
        "cost",
        {
            "tier_load_rates_tokens_per_s": {"CPU": 20_000.0, "DISK": 2_000.0},
            "fleet_backlog_share": rng.choice([0.0, 0.5, None]),
            "decode_slowdown_per_running": rng.choice([0.0, 0.05]),
            "backlog_unit": unit,
        },
    )
    assert isinstance(policy, CostPolicy)
    p = policy.params
    assert isinstance(p, CostParams)
    chains = [[rng.getrandbits(40) for _ in range(rng.randrange(1, 12))] for _ in range(5)]
    # request id -> (request, its predicted miss, its pod), routed and not complete
    routed: dict[str, tuple[RouteRequest, int, str]] = {}
    for i in range(40):
        keys = rng.choice(chains)[: rng.randrange(1, 12)]
        r = req(rid=f"r{i}", keys=keys, prompt=len(keys) * BS + rng.randrange(0, BS))
        views = []
        for j in range(rng.randrange(1, 6)):
            gpu = rng.randrange(0, len(keys) + 1)
            cpu = rng.randrange(gpu, len(keys) + 1)
            shape = rng.random()  # nothing cached, the GPU tier alone, or every tier
            if shape < 0.3:
                hits = {}
            elif shape < 0.55:
                hits = {"GPU": gpu}
            else:
                hits = {"GPU": gpu, "CPU": cpu, "DISK": cpu}
            views.append(
                PodView(
                    f"p{j}",
                    hits=hits,
                    inflight=rng.randrange(0, 4),
                    outstanding_prefill_tokens=rng.randrange(0, 3000),
                    running=rng.choice([None, rng.randrange(0, 8)]),
                )
            )
        expected = {
            v.pod: (
                policy.queued_tokens(v),
                policy.inflight_hits(v.pod, keys),
            )
            for v in views
        }
        backlog = sum(q for q, _ in expected.values()) / len(views)
        live = [m for _, m, _ in routed.values()]
        mean_miss = sum(live) / len(live) if live else r.prompt_tokens
        assert policy.backlog_unit_tokens(r.prompt_tokens) == max(1.0, mean_miss)
        d = policy.pick(r, views)
        for v in views:
            queued, inflight = expected[v.pod]
            # the backlog-adjusted miss weight, as the module docstring states it
            own = max(queued, float(policy.live_uncached(v.pod)))
            share = 1 / len(views) if p.fleet_backlog_share is None else p.fleet_backlog_share
            b = max(share * backlog, min(backlog, own))
            if unit == "request":  # 1 + the followers: b in units of the mean live miss
                w = p.miss_weight + b / policy.backlog_unit_tokens(r.prompt_tokens)
            else:  # the formula before, with its fitted default weight 12
                w = p.miss_weight + 12.0 * b / max(1, r.prompt_tokens)
            assert d.detail["miss_weight"][v.pod] == pytest.approx(w, rel=1e-12)
            ttft, cached = predict_ttft(r, v, p, queued, inflight, d.detail["miss_weight"][v.pod])
            assert d.scores[v.pod] == ttft
            assert d.detail["cached_tokens"][v.pod] == cached
        assert d.scores[d.pod] <= min(d.scores.values()) + p.tie_epsilon_s
        policy.on_routed(r, d.pod)
        routed[r.request_id] = (r, r.prompt_tokens - d.detail["cached_tokens"][d.pod], d.pod)
        if rng.random() < 0.5:
            done, _, pod = routed.pop(rng.choice(list(routed)))
            policy.on_complete(done, pod)


def test_cost_sends_a_request_to_the_pod_holding_its_prefix() -> None:
    views = [PodView("a"), PodView("b", hits={"GPU": 30}), PodView("c")]
    assert build_policy("cost").pick(req(keys=list(range(32))), views).pod == "b"


def test_cost_leaves_a_cached_pod_whose_queue_costs_more_than_the_recompute() -> None:
    policy = build_policy("cost", {"prefill_rate_tokens_per_s": 1000.0, "backlog_weight": 0.0})
    # b saves 480 tokens (0.48 s) but has 5,000 tokens (5 s) queued
    views = [PodView("a"), PodView("b", hits={"GPU": 30}, outstanding_prefill_tokens=5000)]
    decision = policy.pick(req(keys=list(range(32))), views)
    assert decision.pod == "a"
    assert decision.lower_is_better
    assert decision.scores["b"] > decision.scores["a"]


def test_cost_tie_break_is_deterministic_per_request_and_unbiased_across_pods() -> None:
    policy = build_policy("cost")
    counts = Counter(policy.pick(req(f"id-{i}", keys=[i]), pods(4)).pod for i in range(400))
    assert set(counts) == {"p0", "p1", "p2", "p3"}
    assert max(counts.values()) < 160
    again = build_policy("cost")
    assert all(
        again.pick(req(f"id-{i}", keys=[i]), pods(4)).pod
        == policy.pick(req(f"id-{i}", keys=[i]), pods(4)).pod
        for i in range(20)
    )


def test_cost_starts_a_prefix_nobody_holds_on_the_pod_with_the_most_cache_room() -> None:
    """A tie (same load, nothing cached) goes to the pods whose caches hold the fewest
    blocks: new prefix groups spread out instead of evicting each other on one pod."""
    policy = build_policy("cost")
    views = [PodView(pod=f"p{i}", resident_blocks=n) for i, n in enumerate([900, 40, 40, 700])]
    chosen = Counter(policy.pick(req(f"id-{i}", keys=[i]), views).pod for i in range(200))
    assert set(chosen) == {"p1", "p2"}  # the two emptiest, drawn between evenly
    assert min(chosen.values()) > 60


def test_cost_weighs_room_by_free_blocks_when_the_caches_differ_in_size() -> None:
    """A fleet of different cache sizes: the most *free* blocks wins the tie, not the
    fewest resident ones (a small cache holding little can still be the fullest)."""
    policy = build_policy("cost")
    views = [
        PodView(pod="big", resident_blocks=4_000, capacity_blocks=10_000),  # 6,000 free
        PodView(pod="small", resident_blocks=1_000, capacity_blocks=2_000),  # 1,000 free
        PodView(pod="mid", resident_blocks=0, capacity_blocks=5_000),  # 5,000 free
    ]
    assert {policy.pick(req(f"id-{i}", keys=[i]), views).pod for i in range(100)} == {"big"}
    # a capacity unknown on one tied pod: back to the fewest resident blocks
    partly = [*views[:2], PodView(pod="mid", resident_blocks=0)]
    assert {policy.pick(req(f"id-{i}", keys=[i]), partly).pod for i in range(100)} == {"mid"}


def test_cost_room_only_breaks_ties_and_can_be_turned_off() -> None:
    policy = build_policy("cost")
    held = [
        PodView(pod="p0", hits={"GPU": 4}, resident_blocks=5_000),
        PodView(pod="p1", resident_blocks=0),
    ]
    assert policy.pick(req("r", keys=[1, 2, 3, 4]), held).pod == "p0"  # the hit wins
    by_hash = build_policy("cost", {"tie_break_by_room": False})
    views = [PodView(pod=f"p{i}", resident_blocks=n) for i, n in enumerate([900, 40, 40, 700])]
    assert {by_hash.pick(req(f"id-{i}", keys=[i]), views).pod for i in range(200)} == {
        "p0",
        "p1",
        "p2",
        "p3",
    }
    unknown = [*views[:3], PodView(pod="p3")]  # one count unknown: plain rendezvous
    assert len({policy.pick(req(f"id-{i}", keys=[i]), unknown).pod for i in range(200)}) == 4


def test_cost_counts_prefixes_of_in_flight_requests_before_the_index_sees_them() -> None:
    policy = build_policy("cost")
    first = req("1", keys=list(range(40)))
    pod = policy.pick(first, pods(4)).pod
    policy.on_routed(first, pod)
    # its first token is back but the pod's KV events are not: the index knows nothing
    views = [PodView(f"p{i}", inflight=int(f"p{i}" == pod)) for i in range(4)]
    second = req("2", keys=list(range(40)))
    decision = policy.pick(second, views)
    assert decision.pod == pod
    assert decision.detail["cached_tokens"][pod] == 640
    policy.on_complete(first, pod)
    assert policy.inflight_hits(pod, second.block_keys) == 0  # type: ignore[attr-defined]


def test_cost_discounts_queued_work_it_predicted_to_hit() -> None:
    policy = build_policy("cost", {"prefill_rate_tokens_per_s": 1000.0})
    r = req("1", keys=list(range(10)), prompt=160)
    policy.pick(r, [PodView("a", hits={"GPU": 9})])  # predicted 16 of 160 tokens uncached
    policy.on_routed(r, "a")
    queued = policy.queued_tokens(PodView("a", outstanding_prefill_tokens=160))  # type: ignore[attr-defined]
    assert queued == pytest.approx(16.0)


def test_cost_keeps_a_loaded_fleet_on_the_cached_pod_by_charging_misses_for_the_backlog() -> None:
    # same pods as above, but both are backlogged: a miss on a now delays that backlog
    views = [
        PodView("a", outstanding_prefill_tokens=4000),
        PodView("b", hits={"GPU": 30}, outstanding_prefill_tokens=5000),
    ]
    policy = build_policy("cost", {"prefill_rate_tokens_per_s": 1000.0})
    decision = policy.pick(req(keys=list(range(32))), views)
    assert decision.pod == "b"
    # b(a) = max(1/2 (2 pods) * mean backlog 4500, min(4500, a's own 4000)); with no live request
    # to measure a mean miss from, one request of backlog is this one's 512 tokens
    assert decision.detail["miss_weight"]["a"] == pytest.approx(1.0 + 4000 / 512)


def test_cost_counts_the_backlog_in_requests_of_the_mean_live_miss() -> None:
    """A miss delays every request that queues behind it: w = 1 + the backlog counted
    in requests, each the mean predicted miss of the requests in flight (Little's law:
    as many arrive while it holds the queue as are queued now)."""
    policy = build_policy("cost", {"prefill_rate_tokens_per_s": 1000.0})
    live = []
    for i, cached_blocks in enumerate([2, 6]):  # predicted misses 128 and 64 tokens
        r = req(f"live{i}", keys=list(range(100 * i, 100 * i + 10)), prompt=160)
        policy.pick(r, [PodView("a", hits={"GPU": cached_blocks})])
        policy.on_routed(r, "a")
        live.append(r)
    assert policy.backlog_unit_tokens(512) == pytest.approx(96.0)  # type: ignore[attr-defined]
    views = [PodView("a", outstanding_prefill_tokens=320), PodView("b")]
    d = policy.pick(req(keys=list(range(32))), views)
    # a's queue: 320 tokens discounted to its predicted misses, 192 = 2 requests of 96,
    # capped at the fleet's mean backlog (96 tokens = 1 request)
    assert d.detail["miss_weight"]["a"] == pytest.approx(1.0 + 96 / 96)
    # b is idle: it charges its share of the fleet's mean backlog, 1/2 with 2 pods
    assert d.detail["miss_weight"]["b"] == pytest.approx(1.0 + 0.5 * 96 / 96)
    # a share set explicitly replaces 1 / pods
    fixed = build_policy(
        "cost", {"prefill_rate_tokens_per_s": 1000.0, "fleet_backlog_share": 0.125}
    )
    for r in live:
        fixed.pick(r, [PodView("a")])
        fixed.on_routed(r, "a")
    d = fixed.pick(req(keys=list(range(32))), views)
    assert d.detail["miss_weight"]["b"] == pytest.approx(1.0 + 0.125 * 160 / 160)
    policy.on_complete(live[0], "a")
    assert policy.backlog_unit_tokens(512) == pytest.approx(64.0)  # type: ignore[attr-defined]
    policy.on_complete(live[1], "a")  # none live: this request's size
    assert policy.backlog_unit_tokens(512) == pytest.approx(512.0)  # type: ignore[attr-defined]


def test_cost_counts_a_backlog_in_prompts_with_the_fitted_weight_when_asked() -> None:
    views = [
        PodView("a", outstanding_prefill_tokens=4000),
        PodView("b", hits={"GPU": 30}, outstanding_prefill_tokens=5000),
    ]
    policy = build_policy("cost", {"prefill_rate_tokens_per_s": 1000.0, "backlog_unit": "prompt"})
    decision = policy.pick(req(keys=list(range(32))), views)
    assert decision.pod == "b"
    assert decision.detail["miss_weight"]["a"] == pytest.approx(1.0 + 12.0 * 4000 / 512)
    zero = build_policy("cost", {"backlog_weight": 0.0}).pick(req(keys=list(range(32))), views)
    assert set(zero.detail["miss_weight"].values()) == {1.0}  # the pure TTFT prediction


def test_cost_on_an_idle_fleet_weighs_a_miss_as_its_own_prefill_only() -> None:
    decision = build_policy("cost").pick(req(keys=list(range(8))), pods(3))
    assert decision.detail["miss_weight"] == {"p0": 1.0, "p1": 1.0, "p2": 1.0}
    assert decision.scores == {p: pytest.approx(128 / 5000.0) for p in ("p0", "p1", "p2")}


def test_cost_does_not_let_one_hot_pods_queue_price_misses_on_idle_pods() -> None:
    # the hot pod holds a shared prefix (20 of 32 blocks) and a queue of 3,000 tokens
    views = [PodView("hot", hits={"GPU": 20}, outstanding_prefill_tokens=3000), *pods(3)]
    r = req(keys=list(range(32)))
    per_pod = build_policy("cost", {"prefill_rate_tokens_per_s": 1000.0}).pick(r, views)
    assert per_pod.pod != "hot"  # an idle pod computes 320 more tokens instead of a 3 s wait
    # an idle pod charges its 1/4 share (4 pods) of the fleet's mean backlog (750 tokens)
    assert per_pod.detail["miss_weight"]["p0"] == pytest.approx(1.0 + 187.5 / 512)
    fleet = build_policy(
        "cost",
        {"prefill_rate_tokens_per_s": 1000.0, "fleet_backlog_share": 1.0, "backlog_unit": "prompt"},
    ).pick(r, views)
    # with the prompt unit the whole fleet mean makes every miss cost w = 18.6:
    # 3000 + 18.6*192 < 18.6*512
    assert fleet.pod == "hot"


def test_cost_keeps_two_live_requests_apart_even_when_a_client_reuses_their_id() -> None:
    policy = build_policy("cost")
    a = req("same-id", keys=[1, 2, 3])
    b = req("same-id", keys=[7, 8, 9])
    policy.on_routed(a, "p0")
    policy.on_routed(b, "p1")
    policy.on_complete(a, "p0")
    assert policy.inflight_hits("p0", [1, 2, 3]) == 0  # type: ignore[attr-defined]
    assert policy.inflight_hits("p1", [7, 8, 9]) == 3  # type: ignore[attr-defined]
