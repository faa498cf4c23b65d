"""Pods of different speeds in the replay: an older GPU next to newer ones.

``pod_speed`` scales every duration of a pod (both pod models); the offered load counts
the fleet's compute as the sum of its speeds; the matrix's ``mixed`` fleet pairs the
larger caches with the faster pods; ``kvroute replay --pod-speed`` sets it per pod."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scoring.policies import build_policy
from scoring.replay import matrix
from scoring.replay.cli import main
from scoring.replay.engine import replay_policy
from scoring.replay.fleet_args import fleet_defaults, parse_pod_speed
from scoring.replay.offered_load import offered_load
from scoring.replay.presets import PRESETS
from scoring.replay.simpod import ReplayConfigError
from scoring.replay.step_cost import StepCost, StepWork
from scoring.replay.trace import load_trace
from scoring.replay.vllm_pod import VllmFleetConfig
from tests.scoring.test_replay import fleet as simple_fleet
from tests.scoring.test_replay import mooncake_row, write_jsonl
from tests.scoring.test_vllm_pod import busy_rows, write_mooncake


def test_a_half_speed_simple_pod_prefills_and_decodes_in_twice_the_time(tmp_path: Path) -> None:
    # one request: 4 blocks of 512 tokens at 1024 tokens/s, then 19 tokens decoded
    trace = load_trace(write_jsonl(tmp_path / "t.jsonl", [mooncake_row(0, [1, 2, 3, 4], out=20)]))
    runs = []
    for speed in (1.0, 0.5):
        cfg = simple_fleet(
            pods=1, prefill_rate=1024.0, decode_interference=0.0, pod_speed=(speed,)
        ).validate()
        runs.append(replay_policy(trace, build_policy("round_robin"), cfg))
    fast, slow = runs
    assert (fast.ttft_s, fast.busy_s) == ([pytest.approx(2.0)], [pytest.approx(2.0)])
    assert (slow.ttft_s, slow.busy_s) == ([pytest.approx(4.0)], [pytest.approx(4.0)])
    assert slow.last_finish_s == pytest.approx(2.0 * fast.last_finish_s)
    assert fast.last_finish_s == pytest.approx(2.0 + 19 / 40.0)


def test_a_step_cost_scaled_by_a_factor_takes_that_multiple_of_every_step() -> None:
    cost = StepCost(0.01, 1e-4, 1e-8, 2e-4, 1e-7)
    work = StepWork(prefill_tokens=512, prefill_pairs=9000, decode_seqs=7, decode_context=3000)
    assert cost.scaled(2.0).seconds(work) == pytest.approx(2.0 * cost.seconds(work))
    assert cost.scaled(2.0).decode_run_s(4, 100, 10) == pytest.approx(
        2.0 * cost.decode_run_s(4, 100, 10)
    )


def test_a_half_speed_vllm_pod_runs_the_same_steps_in_twice_the_engine_time(
    tmp_path: Path,
) -> None:
    trace = load_trace(write_mooncake(tmp_path, busy_rows(n_conv=1, turns=1)))
    engine = PRESETS["llama3-8b-h100"]
    runs = []
    for speed in (1.0, 0.5):
        cfg = VllmFleetConfig(
            pods=1, capacity_tokens=512 * 40, block_size=512, engine=engine, pod_speed=(speed,)
        ).validate()
        runs.append(replay_policy(trace, build_policy("round_robin"), cfg))
    fast, slow = runs
    assert fast.engine_steps == slow.engine_steps
    assert slow.busy_s[0] == pytest.approx(2.0 * fast.busy_s[0])
    overhead = engine.request_overhead_s  # outside the engine's steps: not scaled
    assert slow.ttft_s[0] - overhead == pytest.approx(2.0 * (fast.ttft_s[0] - overhead))


def test_the_offered_load_counts_the_fleet_compute_as_the_sum_of_its_speeds(
    tmp_path: Path,
) -> None:
    trace = load_trace(write_mooncake(tmp_path, busy_rows()))
    even = simple_fleet(pods=4)
    mixed = simple_fleet(pods=4, pod_speed=(4 / 3, 2 / 3, 4 / 3, 2 / 3)).validate()
    halved = simple_fleet(pods=4, pod_speed=(0.5,) * 4, decode_interference=0.0).validate()
    assert mixed.total_speed == pytest.approx(4.0)
    assert offered_load(trace, mixed) == pytest.approx(offered_load(trace, even))
    assert offered_load(trace, halved) == pytest.approx(
        2.0 * offered_load(trace, simple_fleet(pods=4, decode_interference=0.0)), rel=0.05
    )
    engine = PRESETS["llama3-8b-h100"]
    v_even = VllmFleetConfig(pods=4, capacity_tokens=512 * 40, block_size=512, engine=engine)
    v_half = VllmFleetConfig(
        pods=4, capacity_tokens=512 * 40, block_size=512, engine=engine, pod_speed=(0.5,) * 4
    ).validate()
    assert offered_load(trace, v_half) == pytest.approx(2.0 * offered_load(trace, v_even))


@pytest.mark.parametrize(
    "speeds, named",
    [
        ((1.0, 1.0), "pod-speed must list 4 pods"),
        ((1.0, 1.0, 0.0, 1.0), "pod-speed must be finite numbers > 0"),
        ((1.0, float("nan"), 1.0, 1.0), "pod-speed must be finite numbers > 0"),
        ((1.0, -2.0, 1.0, 1.0), "pod-speed must be finite numbers > 0"),
    ],
)
def test_invalid_pod_speeds_are_rejected_naming_them(speeds: tuple[float, ...], named: str) -> None:
    with pytest.raises(ReplayConfigError, match=named):
        simple_fleet(pods=4, pod_speed=speeds).validate()
    with pytest.raises(ReplayConfigError, match=named):
        VllmFleetConfig(
            pods=4,
            capacity_tokens=512 * 40,
            block_size=512,
            engine=PRESETS["llama3-8b-h100"],
            pod_speed=speeds,
        ).validate()


def test_the_mixed_fleet_pairs_the_larger_caches_with_the_faster_pods() -> None:
    cell = matrix.Cell("chat", 4, "mixed", "medium", 0.8)
    trace = matrix.load_workload(
        "chat", 0, limit=200, block_size=16, traces_dir=str(matrix.TRACES_DIR)
    )
    simple = matrix.fleet_for(cell, trace)
    unequal = matrix.fleet_for(matrix.Cell("chat", 4, "unequal", "medium", 0.8), trace)
    assert simple.pod_capacity_tokens == unequal.pod_capacity_tokens
    assert simple.pod_speed == pytest.approx((4 / 3, 2 / 3, 4 / 3, 2 / 3))
    caps = simple.pod_capacity_tokens or ()
    assert caps[0] > caps[1]  # the fast pod has the larger cache
    vllm = matrix.pod_fleet(simple, "vllm")
    assert vllm.pod_speed == simple.pod_speed
    out = matrix.run_cell(cell, 0, policies=["cost", "round_robin"], limit=200, pod_model="vllm")
    assert out["cell"] == "chat/p4-mixed/medium/load80"
    assert out["fleet"]["pod_speed"] == pytest.approx([4 / 3, 2 / 3, 4 / 3, 2 / 3])
    assert all(m["busy_vs_capacity"] > 0 for m in out["policies"].values())
    assert ("chat", 4, "mixed") in {(c.workload, c.pods, c.caches) for c in matrix.full_matrix()}


def test_an_unknown_fleet_kind_is_rejected_naming_the_kinds() -> None:
    trace = matrix.load_workload(
        "chat", 0, limit=50, block_size=16, traces_dir=str(matrix.TRACES_DIR)
    )
    with pytest.raises(ReplayConfigError, match="equal, unequal, mixed"):
        matrix.fleet_for(matrix.Cell("chat", 4, "fancy", "medium", 0.8), trace)


def test_the_cli_repeats_the_pod_speed_list_over_the_pods(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert parse_pod_speed("1,0.5", 5) == (1.0, 0.5, 1.0, 0.5, 1.0)
    assert parse_pod_speed(None, 3) is None
    path = write_mooncake(tmp_path, busy_rows(n_conv=4, turns=2))
    args = [str(path), "--pods", "4", "--pod-speed", "1,0.5", "--policy", "cost", "--json"]
    assert main([*args, "--capacity-tokens", str(512 * 20)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fleet"]["pod_speed"] == [1.0, 0.5, 1.0, 0.5]
    assert main([*args, "--pod-model", "vllm"]) == 0
    assert json.loads(capsys.readouterr().out)["fleet"]["pod_speed"] == [1.0, 0.5, 1.0, 0.5]


@pytest.mark.parametrize(
    "speed, named",
    [("fast", "pod-speed must be comma-separated numbers"), ("1,0", "finite numbers > 0")],
)
def test_the_cli_rejects_a_bad_pod_speed_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], speed: str, named: str
) -> None:
    path = write_mooncake(tmp_path, [(0, [1], 512, 3)])
    assert main([str(path), "--capacity-tokens", "4096", "--pod-speed", speed]) == 2
    err = capsys.readouterr().err
    assert named in err and err.count("\n") == 1


def test_the_cost_policy_replays_on_a_mixed_speed_fleet(tmp_path: Path) -> None:
    """Every request is served, and the fast pods (twice the speed, twice the cache)
    take more of the work than the slow ones."""
    trace = load_trace(write_mooncake(tmp_path, busy_rows(n_conv=12, turns=4)))
    cfg = simple_fleet(pods=4, pod_speed=(4 / 3, 2 / 3, 4 / 3, 2 / 3)).validate()
    run = replay_policy(trace, build_policy("cost", fleet_defaults("cost", cfg)), cfg)
    per_pod = [run.pod_of.count(i) for i in range(4)]
    assert sum(per_pod) == len(trace.requests)
    assert per_pod[0] + per_pod[2] > per_pod[1] + per_pod[3]
