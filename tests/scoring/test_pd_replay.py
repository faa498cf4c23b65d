"""Replay in P/D mode: split requests pay the hop, direct ones the decode pods' prefill,
and local prefills show up in the ITL of the requests decoding beside them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scoring.pd import PDParams, PDRouter
from scoring.policies.base import RouteRequest
from scoring.policies.registry import build_policy
from scoring.replay.cli import main
from scoring.replay.families import generate
from scoring.replay.pd_engine import replay_pd, summarize_pd
from scoring.replay.simpod import FleetConfig
from scoring.replay.trace import Trace, TraceRequest

CFG = FleetConfig(pods=1, capacity_tokens=100_000, block_size=16, prefill_rate=8000.0)


@pytest.fixture(scope="module")
def trace() -> Trace:
    return generate("chat", seed=3, conversations=60, warmup_quantile=0.0)


def test_never_splitting_prefills_on_decode_pods_and_stalls_their_decodes(trace: Trace) -> None:
    never = PDParams(min_uncached_tokens=10**9)
    always = PDParams(always_split=True)
    local = replay_pd(trace, PDRouter(build_policy("cost"), never), CFG, 2, 2)
    split = replay_pd(trace, PDRouter(build_policy("cost"), always), CFG, 2, 2)
    assert not any(local.split) and all(split.split)
    # the prompts prefilled beside a decode delay its tokens; pulled prompts do not
    assert summarize_pd(local)["itl_p90_s"] > summarize_pd(split)["itl_p90_s"]


def test_always_splitting_pays_the_prefill_pod_and_the_hop_before_the_first_token(
    trace: Trace,
) -> None:
    params = PDParams(always_split=True, hop_overhead_s=0.05)
    run = replay_pd(trace, PDRouter(build_policy("round_robin"), params), CFG, 2, 2)
    split = [i for i, s in enumerate(run.split) if s]
    assert len(split) >= 0.9 * len(run.split)
    assert all(run.ttft_s[i] >= 0.05 for i in split)
    s = summarize_pd(run)
    assert s["disaggregation_rate"] == len(split) / len(run.split)


def test_cache_aware_prefill_choice_hits_more_than_round_robin(trace: Trace) -> None:
    always = {"always_split": True}
    cost = replay_pd(trace, PDRouter(build_policy("cost"), PDParams(**always)), CFG, 4, 2)
    rr = replay_pd(trace, PDRouter(build_policy("round_robin"), PDParams(**always)), CFG, 4, 2)
    assert summarize_pd(cost)["hit_rate"] > summarize_pd(rr)["hit_rate"]


def test_the_cli_runs_pd_mode_and_names_bad_pool_sizes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": i * 200, "input_length": 2048, "output_length": 8, "hash_ids": [i % 3, i]}
        for i in range(40)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [str(path), "--capacity-tokens", "100000", "--no-progress"]
    assert main([*args, "--prefill-pods", "2", "--decode-pods", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["pd"]) == {"cost", "round_robin"}
    assert out["fleet"]["prefill_pods"] == 2
    assert main([*args, "--prefill-pods", "2", "--decode-pods", "0"]) == 2
    assert "--decode-pods >= 1" in capsys.readouterr().err


def _request(i: int, at_s: float, blocks: list[int]) -> TraceRequest:
    route = RouteRequest(
        request_id=f"r{i}",
        model="m",
        prompt_tokens=16 * len(blocks),
        block_keys=blocks,
        block_size=16,
    )
    return TraceRequest(arrival_s=at_s, output_tokens=8, route=route)


def test_by_default_a_cold_long_prompt_splits_and_its_follow_up_on_the_decode_pod_goes_direct() -> (
    None
):
    # a 2,048-token prompt on an idle fleet, then the same prompt plus 2 blocks 10 s later
    # (the decode pod pulled the first one's blocks and holds them: 32 new tokens)
    first = list(range(128))
    reqs = [_request(0, 0.0, first), _request(1, 10.0, [*first, 1000, 1001])]
    trace = Trace(requests=reqs, block_size=16, fmt="test")
    run = replay_pd(trace, PDRouter(build_policy("cost"), PDParams()), CFG, 2, 2)
    assert run.split == [True, False]
