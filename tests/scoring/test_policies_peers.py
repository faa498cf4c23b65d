"""The peers' policies, side by side with ours: ``dynamo`` (Dynamo's KV router cost) and
``llmd`` (llm-d's precise scheduling profile with its prefix-cache affinity filter)."""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import pytest

from scoring.policies import PodView, RouteRequest, build_policy
from scoring.policies.base import NoCandidatesError
from scoring.policies.dynamo import DynamoPolicy, softmax_pick
from scoring.policies.llmd import LlmdPolicy
from scoring.policies.prefill_load import ActivePrefill
from scoring.policies.registry import PolicyConfigError
from scoring.replay.cli import main
from scoring.replay.engine import replay_policy
from scoring.replay.fleet_args import fleet_defaults
from scoring.replay.report import summarize
from scoring.replay.trace import load_trace
from tests.scoring.test_replay import conversations, fleet, write_jsonl

BS = 16


def req(rid: str = "r", keys: list[int] | None = None, prompt: int | None = None) -> RouteRequest:
    keys = keys if keys is not None else []
    return RouteRequest(
        request_id=rid,
        model="m",
        prompt_tokens=prompt if prompt is not None else len(keys) * BS,
        block_keys=keys,
        block_size=BS,
    )


def dynamo(**params: object) -> DynamoPolicy:
    policy = build_policy("dynamo", params)
    assert isinstance(policy, DynamoPolicy)
    return policy


def llmd(**params: object) -> LlmdPolicy:
    policy = build_policy("llmd", params)
    assert isinstance(policy, LlmdPolicy)
    return policy


KEYS = list(range(100, 108))  # an 8-block, 128-token prompt


# --- the shared prefill ledger -------------------------------------------------------


def test_active_prefill_counts_the_uncached_tokens_of_the_newest_requests_still_in_prefill() -> (
    None
):
    ledger = ActivePrefill()
    first, second = req("a", prompt=100), req("b", prompt=60)
    ledger.scored(first, {"p0": 40})
    ledger.routed(first, "p0")
    ledger.scored(second, {"p0": 10})
    ledger.routed(second, "p0")
    # both in prefill: 40 + 10 uncached
    assert ledger.tokens(PodView("p0", outstanding_prefill_tokens=160)) == 50
    # the first has its first token (FCFS): only the second's 10 remain
    assert ledger.tokens(PodView("p0", outstanding_prefill_tokens=60)) == 10
    assert ledger.tokens(PodView("p0", outstanding_prefill_tokens=0)) == 0
    # tokens nobody routed through this policy (another replica's) count whole
    assert ledger.tokens(PodView("p0", outstanding_prefill_tokens=260)) == 150
    ledger.complete(second)
    assert ledger.live_requests("p0") == 1


def test_active_prefill_counts_a_retried_or_unscored_request_whole() -> None:
    ledger = ActivePrefill()
    r = req("a", prompt=100)
    ledger.scored(r, {"p0": 0})
    ledger.routed(r, "p1")  # scored for p0 only
    assert ledger.tokens(PodView("p1", outstanding_prefill_tokens=100)) == 100
    assert ledger.live_requests("p0") == 0


# --- dynamo ------------------------------------------------------------------------


def test_dynamo_cost_is_the_published_linear_formula() -> None:
    policy = dynamo()
    views = [PodView("warm", hits={"GPU": 4}), PodView("cold")]
    d = policy.pick(req(keys=KEYS), views)
    # raw = 128/16 = 8 blocks; warm: adjusted 8 - 4 = 4, decode 8 -> 12; cold: 8 + 8 = 16
    assert d.lower_is_better
    assert d.scores == {"warm": 12.0, "cold": 16.0}
    assert d.pod == "warm"


def test_dynamo_credits_overlap_per_tier_device_host_disk() -> None:
    policy = dynamo()
    view = PodView("p", hits={"GPU": 2, "CPU": 4, "DISK": 8})
    d = policy.pick(req(keys=KEYS), [view])
    row = d.detail["workers"]["p"]
    # 2 device blocks x 1.0 + 2 more host blocks x 0.75 + 4 more disk blocks x 0.25
    assert row["overlap_credit_blocks"] == pytest.approx(2 + 1.5 + 1.0)
    assert row["adjusted_prefill_blocks"] == pytest.approx(8 - 4.5)
    tuned = dynamo(overlap_score_credit=0.5, host_cache_hit_weight=0.0, disk_cache_hit_weight=1.0)
    row = tuned.pick(req(keys=KEYS), [view]).detail["workers"]["p"]
    assert row["overlap_credit_blocks"] == pytest.approx(1.0 + 0.0 + 4.0)


def route(
    policy: DynamoPolicy | LlmdPolicy, r: RouteRequest, views: list[PodView], pod: str
) -> None:
    policy.pick(r, views)
    policy.on_routed(r, pod)


def test_dynamo_decode_load_pushes_a_request_off_the_pod_holding_its_prefix() -> None:
    policy = dynamo()
    views = [PodView("warm", hits={"GPU": 4}), PodView("cold")]
    busy = [req(f"busy{i}", keys=[10 * i + k for k in range(5)]) for i in range(2)]
    for r in busy:
        route(policy, r, views, "warm")
    # two live requests of 5 distinct blocks on "warm": 4 + (10 + 8) = 22 > 8 + 8
    assert policy.decode_blocks("warm", KEYS) == 18
    assert policy.pick(req(keys=KEYS), views).pod == "cold"
    for r in busy:  # they finish: the prefix wins again (4 + 8 = 12 < 16)
        policy.on_complete(r, "warm")
    assert policy.pick(req(keys=KEYS), views).pod == "warm"


def test_dynamo_counts_blocks_shared_with_live_requests_once() -> None:
    policy = dynamo()
    views = [PodView("p0"), PodView("p1")]
    live = req("live", keys=KEYS[:6])
    route(policy, live, views, "p0")
    assert policy.decode_blocks("p0", KEYS) == 8  # 6 active + 2 new
    assert policy.decode_blocks("p1", KEYS) == 8
    policy.on_complete(live, "p0")
    assert policy.decode_blocks("p0", []) == 0


def test_dynamo_active_prefill_pushes_a_request_off_a_backlogged_cached_pod() -> None:
    policy = dynamo(track_active_blocks=False)
    route(
        policy, req("backlog", keys=list(range(50, 58))), [PodView("warm"), PodView("cold")], "warm"
    )
    views = [PodView("warm", hits={"GPU": 4}, outstanding_prefill_tokens=128), PodView("cold")]
    d = policy.pick(req(keys=KEYS), views)
    warm = d.detail["workers"]["warm"]
    assert warm["active_prefill_tokens"] == 128  # the backlog's predicted uncached tokens
    assert warm["raw_prefill_blocks"] == 16  # (128 + 128) / 16
    assert d.scores == {"warm": 16.0 - 4.0, "cold": 8.0}
    assert d.pod == "cold"


def test_dynamo_overlap_credit_decays_on_pods_with_excess_prefill() -> None:
    # 128 outstanding tokens nobody routed here count whole: 8 blocks = 1 request of excess
    views = [PodView("warm", hits={"GPU": 8}, outstanding_prefill_tokens=128), PodView("cold")]
    plain = dynamo(track_active_blocks=False).pick(req(keys=KEYS), views)
    decayed = dynamo(track_active_blocks=False, overlap_score_credit_decay=1.0).pick(
        req(keys=KEYS), views
    )
    assert plain.detail["workers"]["warm"]["overlap_credit_blocks"] == 8
    assert decayed.detail["workers"]["warm"]["overlap_credit_blocks"] == pytest.approx(4)
    assert plain.scores == {"warm": 8.0, "cold": 8.0}
    assert decayed.scores == {"warm": 12.0, "cold": 8.0}
    assert decayed.pod == "cold"


def test_dynamo_lmetric_multiplies_prefill_by_decode_load() -> None:
    policy = dynamo(selection_policy="lmetric")
    d = policy.pick(req(keys=KEYS), [PodView("warm", hits={"GPU": 4}), PodView("cold")])
    assert d.scores == {"warm": 4.0 * (8 + 1), "cold": 8.0 * (8 + 1)}


def test_dynamo_ties_at_zero_temperature_are_drawn_at_random() -> None:
    policy = dynamo(seed=3)
    picks = Counter(
        policy.pick(req(keys=KEYS), [PodView("a"), PodView("b")]).pod for _ in range(200)
    )
    assert set(picks) == {"a", "b"}


def test_dynamo_temperature_sampling_is_reproducible_with_a_seed_and_spreads_picks() -> None:
    views = [PodView("warm", hits={"GPU": 8}), PodView("half", hits={"GPU": 4}), PodView("cold")]

    def picks(seed: int) -> list[str]:
        policy = dynamo(router_temperature=1.0, seed=seed)
        return [policy.pick(req(keys=KEYS), views).pod for _ in range(600)]

    first = picks(7)
    assert first == picks(7)
    assert first != picks(8)
    counts = Counter(first)
    assert set(counts) == {"warm", "half", "cold"}  # every worker sampled
    assert counts["warm"] > counts["half"] > counts["cold"]  # cheaper is likelier
    assert Counter(dynamo().pick(req(keys=KEYS), views).pod for _ in range(50)) == {"warm": 50}


def test_softmax_pick_follows_normalised_costs() -> None:
    # costs 0 and 1 at temperature 1: p = e^0 / (e^0 + e^-1) = 0.731 for the first
    p0 = 1 / (1 + math.exp(-1))
    assert softmax_pick([0.0, 1.0], 1.0, p0 - 1e-9) == 0
    assert softmax_pick([0.0, 1.0], 1.0, p0 + 1e-9) == 1
    assert softmax_pick([5.0, 5.0, 5.0], 0.5, 0.5) == 1  # equal costs: uniform


@pytest.mark.parametrize("temperature", [0.0, 0.5])
def test_dynamo_gives_finite_costs_on_empty_and_zero_views(temperature: float) -> None:
    policy = dynamo(router_temperature=temperature, overlap_score_credit_decay=1.0)
    for r in (req(keys=[], prompt=0), req(keys=KEYS)):
        d = policy.pick(r, [PodView("a"), PodView("b", inflight=0)])
        assert all(math.isfinite(c) for c in d.scores.values())
    with pytest.raises(NoCandidatesError, match="dynamo"):
        policy.pick(req(keys=KEYS), [])


def test_dynamo_forgets_a_removed_pod() -> None:
    policy = dynamo()
    r = req("x", keys=KEYS)
    route(policy, r, [PodView("p0")], "p0")
    policy.on_pod_removed("p0")
    assert policy.decode_blocks("p0", []) == 0


# --- llmd ----------------------------------------------------------------------------


def test_llmd_prefix_score_is_the_weighted_match_over_prompt_blocks() -> None:
    policy = llmd(affinity_filter=False)
    views = [
        PodView("gpu", hits={"GPU": 4}),
        PodView("mixed", hits={"GPU": 2, "CPU": 5}),  # 2 + 3 x 0.8 = 4.4 -> 4 blocks
        PodView("disk", hits={"DISK": 2}),  # a tier with no configured weight counts 1.0
        PodView("none"),
    ]
    d = policy.pick(req(keys=KEYS), views)
    assert d.detail["prefix"] == {"gpu": 0.5, "mixed": 0.5, "disk": 0.25, "none": 0.0}


def test_llmd_scores_are_weighted_prefix_kv_and_min_max_queue() -> None:
    policy = llmd(affinity_filter=False)
    views = [
        PodView("a", hits={"GPU": 8}, waiting=4, kv_usage=0.5),
        PodView("b", waiting=0, kv_usage=0.1),
        PodView("c", waiting=2, kv_usage=0.0),
    ]
    d = policy.pick(req(keys=KEYS), views)
    assert d.scores == pytest.approx({"a": 2.0 + 0.5 + 0.0, "b": 0.9 + 1.0, "c": 1.0 + 0.5})
    assert d.pod == "a"


def test_llmd_affinity_filter_keeps_only_pods_holding_at_least_80_percent() -> None:
    keys = list(range(10))
    views = [
        PodView("most", hits={"GPU": 9}, waiting=9, kv_usage=0.9),
        PodView("exactly", hits={"GPU": 8}, waiting=9, kv_usage=0.9),
        PodView("some", hits={"GPU": 5}, waiting=0, kv_usage=0.0),  # best without the filter
    ]
    d = llmd(exploration_probability=0.0).pick(req(keys=keys), views)
    assert d.detail["filter"] == "sticky"
    assert d.detail["kept"] == ["most", "exactly"]
    assert d.pod == "most"
    assert d.scores["some"] < min(d.scores["most"], d.scores["exactly"])  # ranks last
    unfiltered = llmd(affinity_filter=False).pick(req(keys=keys), views)
    assert unfiltered.pod == "some"


def test_llmd_affinity_filter_keeps_everyone_when_nobody_is_sticky() -> None:
    d = llmd().pick(req(keys=KEYS), [PodView("a", hits={"GPU": 1}), PodView("b")])
    assert d.detail["filter"] in ("no sticky pod", "exploration")
    assert d.detail["kept"] == ["a", "b"]


def test_llmd_explores_past_the_filter_with_the_configured_probability() -> None:
    views = [PodView("sticky", hits={"GPU": 8}), PodView("other")]
    always = llmd(exploration_probability=1.0).pick(req(keys=KEYS), views)
    assert always.detail["filter"] == "exploration" and always.detail["kept"] == ["sticky", "other"]
    policy = llmd(seed=11)  # default 0.01
    reasons = Counter(policy.pick(req(keys=KEYS), views).detail["filter"] for _ in range(4000))
    assert set(reasons) == {"sticky", "exploration"}
    assert 0.005 < reasons["exploration"] / 4000 < 0.02


def test_llmd_breaks_stickiness_when_the_sticky_pods_ttft_is_5_seconds_worse() -> None:
    policy = llmd(exploration_probability=0.0, peak_prefill_throughput_tokens_per_s=1000.0)
    # 6,000 uncached tokens in flight on the sticky pod: 6 s of predicted TTFT
    backlog = req("backlog", keys=list(range(50, 58)), prompt=6000)
    route(policy, backlog, [PodView("sticky"), PodView("other")], "sticky")
    views = [PodView("sticky", hits={"GPU": 8}, outstanding_prefill_tokens=6000), PodView("other")]
    assert policy.ttft_ms(views[0]) == pytest.approx(6000.0)
    d = policy.pick(req(keys=KEYS), views)
    assert d.detail["filter"] == "ttft gate"
    assert d.detail["kept"] == ["sticky", "other"]
    # 4 s worse is within the 5,000 ms penalty: stay sticky
    views[0] = PodView("sticky", hits={"GPU": 8}, outstanding_prefill_tokens=4000)
    assert policy.pick(req(keys=KEYS), views).detail["filter"] == "sticky"


def test_llmd_differs_from_precise_prefix_by_scoring_the_ratio_not_the_min_max() -> None:
    # "a" holds 1 of 8 blocks but has a long queue; "b" holds nothing and is idle
    views = [PodView("a", hits={"GPU": 1}, waiting=5), PodView("b", waiting=0)]
    assert build_policy("precise_prefix").pick(req(keys=KEYS), views).pod == "a"  # 1.0 x 3
    assert llmd().pick(req(keys=KEYS), views).pod == "b"  # 0.125 x 2 < queue 1.0


def test_llmd_gives_finite_scores_on_empty_and_zero_views() -> None:
    policy = llmd()
    for r in (req(keys=[], prompt=0), req(keys=KEYS)):
        d = policy.pick(r, [PodView("a"), PodView("b")])
        assert all(math.isfinite(s) for s in d.scores.values())
    with pytest.raises(NoCandidatesError, match="llmd"):
        policy.pick(req(keys=KEYS), [])


def test_llmd_clamps_each_scorer_to_the_unit_range() -> None:
    # a bogus KV usage above 1 scores 0, not a negative that would outweigh the queue
    d = llmd().pick(req(keys=KEYS), [PodView("a", kv_usage=1.7), PodView("b", kv_usage=1.0)])
    assert d.scores == {"a": 1.0, "b": 1.0}


# --- parameters ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["dynamo", "llmd"])
def test_unknown_parameter_is_an_error_naming_it(name: str) -> None:
    with pytest.raises(PolicyConfigError, match="bogus_knob"):
        build_policy(name, {"bogus_knob": 1})


@pytest.mark.parametrize(
    ("name", "params", "field"),
    [
        ("dynamo", {"host_cache_hit_weight": 1.5}, "host_cache_hit_weight"),
        ("dynamo", {"overlap_score_credit": -1}, "overlap_score_credit"),
        ("dynamo", {"router_temperature": float("inf")}, "router_temperature"),
        ("dynamo", {"selection_policy": "quadratic"}, "selection_policy"),
        ("llmd", {"affinity_threshold": 1.2}, "affinity_threshold"),
        ("llmd", {"exploration_probability": 2}, "exploration_probability"),
        ("llmd", {"peak_prefill_throughput_tokens_per_s": 0}, "peak_prefill"),
        ("llmd", {"tier_weights": {"CPU": -0.5}}, "tier_weights"),
    ],
)
def test_invalid_parameter_values_are_errors_naming_them(
    name: str, params: dict[str, object], field: str
) -> None:
    with pytest.raises(PolicyConfigError, match=field):
        build_policy(name, params)


# --- replay --------------------------------------------------------------------------


def test_both_peers_replay_a_trace_and_reuse_the_cache(tmp_path: Path) -> None:
    trace = load_trace(write_jsonl(tmp_path / "t.jsonl", conversations()))
    cfg = fleet(capacity_tokens=512 * 40)
    hit = {
        name: summarize(replay_policy(trace, build_policy(name, fleet_defaults(name, cfg)), cfg))[
            "hit_rate"
        ]
        for name in ("round_robin", "dynamo", "llmd")
    }
    assert hit["dynamo"] > 2 * hit["round_robin"]
    assert hit["llmd"] > 2 * hit["round_robin"]


def test_replay_cli_runs_the_peers_with_their_documented_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", conversations(n_conv=4, turns=2))
    argv = [str(path), "--pods", "2", "--capacity-tokens", "20480", "--json"]
    assert main([*argv, "--policy", "dynamo", "--policy", "llmd", "--prefill-rate", "9000"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["policies"]) == {"dynamo", "llmd"}
    assert out["params"]["llmd"]["peak_prefill_throughput_tokens_per_s"] == 9000.0
    assert out["params"]["dynamo"] == DynamoPolicy.Params().model_dump(mode="json")
    assert 0.0 < out["policies"]["llmd"]["hit_rate"] <= 1.0
