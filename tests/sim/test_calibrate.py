"""``kvroute calibrate``: the step-cost fit, its fallbacks, and probing a real pod.

The fit is checked on synthetic measurement sets (exact, noisy, nonsensical); the
probing runs against real simulated pods on 127.0.0.1 — one on the vLLM engine model
with known step costs (calibration must recover them), one that never answers.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from router.sim import SimPod, SimSettings
from router.sim.calibrate import calibrate, decode_row, prefill_row
from scoring.policies import build_policy
from scoring.policies.cost_params import CostParams
from scoring.replay.calibrate_fit import Sample, fastest, fit, repeat_spread, typical
from scoring.replay.preset_file import load_preset_file, spec_to_dict, write_preset_file
from scoring.replay.presets import PRESETS, EngineSpec, PresetError
from scoring.replay.step_cost import PARAMS, StepCost

TRUE = StepCost(
    base_s=0.02, prefill_token_s=5e-5, prefill_pair_s=2e-9, decode_seq_s=4e-3,
    decode_context_token_s=1e-6,
)  # fmt: skip
PRIOR = PRESETS["cpu-tiny"].cost


def seconds(cost: StepCost, row: tuple[float, ...]) -> float:
    return sum(getattr(cost, p) * x for p, x in zip(PARAMS, row, strict=True))


def probe_rows() -> list[tuple[str, tuple[float, ...]]]:
    rows = [(f"prefill/{n}", prefill_row(n, 0, 2048)) for n in (32, 128, 512, 1024, 2000)]
    rows += [(f"cached/{n}", prefill_row(n + 64, n, 2048)) for n in (512, 1024, 1536)]
    rows += [(f"decode/{k}x{n}", decode_row(k, n, 32)) for k in (1, 2, 4, 8) for n in (32, 256)]
    return rows


def exact_samples(cost: StepCost = TRUE) -> list[Sample]:
    return [Sample(row, seconds(cost, row), name) for name, row in probe_rows()]


def test_exact_measurements_give_back_the_parameters_that_made_them() -> None:
    report = fit(exact_samples(), PRIOR)
    assert not report.fell_back and report.from_prior == []
    for p in PARAMS:
        assert getattr(report.cost, p) == pytest.approx(getattr(TRUE, p), rel=1e-6)
    assert report.rel_rms_error < 1e-9


def test_noisy_measurements_give_parameters_near_the_truth() -> None:
    rng = random.Random(7)
    noisy = [Sample(s.row, s.seconds * (1 + rng.gauss(0, 0.03)), s.probe) for s in exact_samples()]
    report = fit(noisy, PRIOR)
    for p in ("base_s", "prefill_token_s", "decode_seq_s"):
        assert getattr(report.cost, p) == pytest.approx(getattr(TRUE, p), rel=0.15)


def test_nan_zero_and_negative_measurements_are_dropped_counted_and_the_rest_fitted() -> None:
    good = exact_samples()
    row = good[0].row
    bad = [
        Sample(row, math.nan, "x"),
        Sample(row, math.inf, "x"),
        Sample(row, 0.0, "x"),
        Sample(row, -1.0, "x"),
        Sample((math.nan,) * 5, 1.0, "x"),
        Sample((1.0, -5.0, 0.0, 0.0, 0.0), 1.0, "x"),
    ]
    report = fit(good + bad, PRIOR)
    assert dict(report.rejected) == {"nan_seconds": 2, "nonpositive_seconds": 2, "bad_work": 2}
    assert report.used == len(good)
    assert report.cost.base_s == pytest.approx(TRUE.base_s, rel=1e-6)


def test_nothing_usable_falls_back_to_every_prior_with_no_nan() -> None:
    row = exact_samples()[0].row
    report = fit([Sample(row, math.nan), Sample(row, -2.0)], PRIOR)
    assert report.fell_back and report.reason
    assert report.cost == PRIOR
    assert report.from_prior == list(PARAMS) and report.fitted == []
    assert all(math.isfinite(getattr(report.cost, p)) for p in PARAMS)


def test_a_parameter_no_probe_exercises_keeps_its_prior() -> None:
    prefill_only = [s for s in exact_samples() if not s.probe.startswith("decode")]
    report = fit(prefill_only, PRIOR)
    assert set(report.from_prior) == {"decode_seq_s", "decode_context_token_s"}
    assert report.cost.decode_seq_s == PRIOR.decode_seq_s
    assert report.cost.prefill_token_s == pytest.approx(TRUE.prefill_token_s, rel=1e-6)


def test_parameters_the_probes_cannot_tell_apart_keep_a_prior_not_a_nan() -> None:
    # one decode shape only: base_s, decode_seq_s and decode_context_token_s collinear
    rows = [decode_row(1, 32, 32)] * 6
    report = fit([Sample(r, seconds(TRUE, r), "d") for r in rows], PRIOR)
    assert report.from_prior, "a collinear parameter must keep its prior"
    assert all(math.isfinite(getattr(report.cost, p)) for p in PARAMS)
    assert seconds(report.cost, rows[0]) == pytest.approx(seconds(TRUE, rows[0]), rel=1e-6)


def test_a_negative_estimate_is_pinned_to_zero_and_the_rest_refitted() -> None:
    # times that shrink with decode context: least squares alone would say c < 0
    truth = (0.02, 5e-5, 0.0, 4e-3, -2e-7)
    samples = [Sample(row, sum(t * x for t, x in zip(truth, row, strict=True)), name)
               for name, row in probe_rows()]  # fmt: skip
    report = fit(samples, PRIOR)
    assert report.cost.decode_context_token_s == 0.0
    assert "decode_context_token_s" in report.fitted  # fitted (to the bound), not a prior
    assert all(getattr(report.cost, p) >= 0 for p in PARAMS)
    assert report.cost.prefill_token_s == pytest.approx(5e-5, rel=0.1)


def test_repeats_are_reduced_to_the_fastest_valid_one() -> None:
    row = (1.0, 10.0, 0.0, 0.0, 0.0)
    kept = fastest([Sample(row, 0.3, "a"), Sample(row, 0.1, "a"), Sample(row, -1.0, "a")])
    assert [s.seconds for s in kept] == [0.1, -1.0]  # the invalid one stays, to be counted


# --- preset files -------------------------------------------------------------------


def test_a_preset_file_round_trips_and_rejects_what_is_wrong(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    spec = PRESETS["cpu-tiny"]
    write_preset_file(path, spec_to_dict(spec, block_size=32, calibration={"x": 1}))
    assert load_preset_file(path) == spec
    data = json.loads(path.read_text())
    for mutate, message in (
        (lambda d: d.__setitem__("typo", 1), "unknown keys"),
        (lambda d: d["cost"].__setitem__("base_s", float("nan")), "cost.base_s must be a finite"),
        (lambda d: d["cost"].__setitem__("decode_seq_s", -1.0), "decode_seq_s must be a finite"),
        (lambda d: d.__setitem__("max_num_seqs", 0), "max_num_seqs must be an integer >= 1"),
        (lambda d: d["cost"].pop("prefill_pair_s"), "missing \\['prefill_pair_s'\\]"),
    ):
        broken = json.loads(json.dumps(data))
        mutate(broken)
        path.write_text(json.dumps(broken))
        with pytest.raises(PresetError, match=message):
            load_preset_file(path)
    path.write_text("{not json")
    with pytest.raises(PresetError, match="not JSON"):
        load_preset_file(path)


# --- probing real pods --------------------------------------------------------------

MakePod = Callable[..., Awaitable[SimPod]]


@pytest.fixture
async def make_pod() -> AsyncIterator[MakePod]:
    pods: list[SimPod] = []

    async def make(**kw: Any) -> SimPod:
        pod = SimPod(SimSettings(kv_events=False, **kw))
        await pod.start()
        pods.append(pod)
        return pod

    yield make
    for pod in pods:
        await pod.stop()


def known_engine(tmp_path: Path) -> Path:
    spec = EngineSpec(
        "known", TRUE, max_num_batched_tokens=512, max_num_seqs=4, max_model_len=1100,
        kv_capacity_tokens=65536,
    )  # fmt: skip
    path = tmp_path / "known.json"
    write_preset_file(path, spec_to_dict(spec))
    return path


async def test_calibrating_a_pod_with_known_step_costs_recovers_them(
    make_pod: MakePod, tmp_path: Path
) -> None:
    pod = await make_pod(
        pod_model="vllm", preset_file=str(known_engine(tmp_path)), block_size=32,
        capacity_tokens=65536, max_model_len=1100,
    )  # fmt: skip
    cal = await calibrate(pod.url, "sim-model", PRESETS["cpu-tiny"], seed=1, repeats=3,
                          given={"max_num_seqs": 4, "max_num_batched_tokens": 512})  # fmt: skip
    assert cal.limits.block_size == 32 and cal.limits.max_model_len == 1100
    assert cal.counts.answered == cal.counts.sent and not cal.report.fell_back
    # the dominant terms; the event loop's timer slack is the measurement error
    for p in ("base_s", "prefill_token_s", "decode_seq_s"):
        assert getattr(cal.spec.cost, p) == pytest.approx(getattr(TRUE, p), rel=0.3), p
    assert cal.report.rel_rms_error < 0.2


async def test_a_pod_that_never_answers_leaves_the_priors_after_a_few_probes(
    make_pod: MakePod,
) -> None:
    # a real pod whose prefill would take hours
    pod = await make_pod(prefill_rate=1e-3, time_scale=1.0)
    cal = await calibrate(pod.url, "sim-model", PRESETS["cpu-tiny"], seed=1, timeout_s=0.3)
    assert cal.report.fell_back and cal.counts.answered == 0
    assert cal.counts.sent == 3 and sum(cal.counts.failed.values()) == 3
    assert cal.spec.cost == PRESETS["cpu-tiny"].cost


def test_kvroute_calibrate_writes_a_loadable_preset_even_when_it_falls_back(
    tmp_path: Path,
) -> None:
    sim = subprocess.Popen(
        [sys.executable, "-m", "router.cli", "sim", "--no-kv-events", "--replay-endpoint",
         "none", "--prefill-rate", "0.001"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert sim.stdout is not None
        url = json.loads(sim.stdout.readline())["url"]
        out = tmp_path / "cal.json"
        argv = ["calibrate", "--url", url, "--model", "sim-model", "--out", str(out)]
        proc = subprocess.run(
            [sys.executable, "-m", "router.cli", *argv, "--timeout", "0.3"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    finally:
        sim.terminate()
        sim.wait(timeout=30)
    assert proc.returncode == 1, proc.stderr
    assert "kept the priors" in proc.stderr
    spec = load_preset_file(out)
    assert spec.cost == PRESETS["cpu-tiny"].cost and not spec.calibrated
    # the router's settings for such a fleet, ready for policy_params: cost
    suggested = json.loads(proc.stdout)["router_policy_params"]
    prior = PRESETS["cpu-tiny"]
    assert suggested == {
        "prefill_rate_tokens_per_s": pytest.approx(prior.prefill_rate_tokens_per_s(), rel=1e-5),
        "decode_slowdown_per_running": pytest.approx(prior.decode_slowdown_per_running(), rel=1e-4),
    }
    params = build_policy("cost", suggested).params
    assert isinstance(params, CostParams)
    assert params.decode_slowdown_per_running is not None
    assert params.decode_slowdown_per_running > 0
    report = json.loads(out.read_text())["calibration"]
    assert report["probes"]["answered"] == 0 and report["report"]["fell_back_to_priors"]


def test_kvroute_replay_runs_on_a_preset_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from scoring.replay.cli import main as replay_main

    trace = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 100 * i, "input_length": 800, "output_length": 20,
             "hash_ids": [i % 3, 10 + i]} for i in range(12)]  # fmt: skip
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    preset = known_engine(tmp_path)
    argv = [str(trace), "--pod-model", "vllm", "--preset-file", str(preset), "--pods", "2"]
    assert replay_main([*argv, "--policy", "round_robin", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)["policies"]["round_robin"]
    # 800-token prompts on the file's engine: at least 800 x prefill_token_s + a step
    assert result["ttft_p50_s"] >= TRUE.base_s + 800 * TRUE.prefill_token_s
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"kvroute_preset": 1}))
    assert replay_main([str(trace), "--pod-model", "vllm", "--preset-file", str(bad)]) != 0
    assert "preset file" in capsys.readouterr().err


def test_the_replay_adds_the_presets_request_overhead_to_every_ttft(tmp_path: Path) -> None:
    from scoring.policies import build_policy
    from scoring.replay.engine import replay_policy
    from scoring.replay.trace import load_trace
    from scoring.replay.vllm_pod import VllmFleetConfig

    trace_path = tmp_path / "trace.jsonl"
    rows = [{"timestamp": 1000 * i, "input_length": 600, "output_length": 4,
             "hash_ids": [i, 100 + i]} for i in range(4)]  # fmt: skip
    trace_path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trace = load_trace(trace_path, "mooncake")
    base = EngineSpec("e", TRUE, 512, 4, 1100, 65536)
    ttfts = []
    for overhead in (0.0, 0.005):
        engine = dataclasses.replace(base, request_overhead_s=overhead)
        cfg = VllmFleetConfig(pods=1, capacity_tokens=65536, block_size=512, engine=engine)
        ttfts.append(replay_policy(trace, build_policy("round_robin"), cfg).ttft_s)
    assert [b - a for a, b in zip(*ttfts, strict=True)] == pytest.approx([0.005] * 4)


def test_the_median_estimate_keeps_the_middle_repeat_of_each_probe() -> None:
    row = (1.0, 10.0, 0.0, 0.0, 0.0)
    reps = [Sample(row, t, "a") for t in (0.3, 0.1, 0.2)] + [Sample(row, math.nan, "a")]
    assert typical(reps)[0].seconds == 0.2
    assert math.isnan(typical(reps)[-1].seconds)  # the invalid one stays, to be counted


def test_the_repeat_spread_says_how_much_repeats_of_a_probe_disagree() -> None:
    row = (1.0, 10.0, 0.0, 0.0, 0.0)
    quiet = [Sample(row, 0.100, "a"), Sample(row, 0.101, "a"), Sample(row, 0.2, "b"),
             Sample(row, 0.2, "b")]  # fmt: skip
    busy = [Sample(row, 0.1, "a"), Sample(row, 0.5, "a"), Sample(row, 0.4, "a")]
    assert repeat_spread(quiet) == pytest.approx(1.0025, rel=1e-3)
    assert repeat_spread(busy) == pytest.approx(4.0)
    assert math.isnan(repeat_spread([Sample(row, 0.1, "a")]))
