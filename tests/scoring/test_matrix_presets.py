"""The matrix on another engine (``bench_quality_matrix.py --preset``): the vLLM pod
model's preset is a held-out dimension like the seeds and the fleet sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scoring.replay import matrix
from scoring.replay.simpod import ReplayConfigError
from tests.support.bench_module import load_bench

CELL = matrix.Cell("chat", 4, "unequal", "small", 1.1)


def test_the_matrix_takes_the_presets_derived_from_published_figures_only() -> None:
    assert matrix.matrix_presets() == ["llama3-8b-h100", "llama3-70b-h100-tp4"]
    assert matrix.VLLM_PRESET in matrix.matrix_presets()
    with pytest.raises(ReplayConfigError, match=r"'cpu-tiny'.*known: llama3-8b-h100"):
        matrix.matrix_preset("cpu-tiny")


def test_a_cell_on_the_70b_engine_keeps_its_caches_and_replays_a_slower_engine() -> None:
    small = matrix.run_cell(CELL, 3, policies=["cost"], limit=150, pod_model="vllm")
    large = matrix.run_cell(
        CELL, 3, policies=["cost"], limit=150, pod_model="vllm", preset="llama3-70b-h100-tp4"
    )
    assert small["fleet"]["preset"] == "llama3-8b-h100"
    assert large["fleet"]["preset"] == "llama3-70b-h100-tp4"
    # the cell's caches are sized to its working set, whatever the engine
    assert large["fleet"]["pod_capacity_tokens"] == small["fleet"]["pod_capacity_tokens"]
    # a 70B model on 4 GPUs prefills fewer tokens a second than an 8B model on one, so the
    # same offered load is a slower trace, and the replay differs
    assert large["fleet"]["prefill_rate"] < small["fleet"]["prefill_rate"]
    assert large["time_scale"] != small["time_scale"]
    assert large["policies"]["cost"]["ttft_p90_s"] != small["policies"]["cost"]["ttft_p90_s"]
    # the simple pod model has no engine to name
    simple = matrix.run_cell(CELL, 3, policies=["round_robin"], limit=60)
    assert "preset" not in simple["fleet"]


def test_the_bench_replays_and_records_another_preset(tmp_path: Path) -> None:
    bench = load_bench("bench_quality_matrix")
    out = tmp_path / "run"
    args = ["--cells", CELL.id, "--limit", "60", "--policy", "round_robin", "--pod-model"]
    args += ["vllm", "--preset", "llama3-70b-h100-tp4", "--out", str(out)]
    assert bench.main(args) == 0
    assert json.loads(out.with_suffix(".json").read_text())["run"]["preset"] == (
        "llama3-70b-h100-tp4"
    )
    assert "pod model `vllm` (engine `llama3-70b-h100-tp4`)" in out.with_suffix(".md").read_text()


def test_the_bench_refuses_a_preset_the_matrix_does_not_take(
    capsys: pytest.CaptureFixture[str],
) -> None:
    bench = load_bench("bench_quality_matrix")
    with pytest.raises(SystemExit) as exc:
        bench.main(["--quick", "--pod-model", "vllm", "--preset", "cpu-tiny"])
    assert exc.value.code == 2
    assert "--preset: invalid choice: 'cpu-tiny'" in capsys.readouterr().err


def test_the_cell_anatomy_names_its_engine_and_session_mode(
    capsys: pytest.CaptureFixture[str],
) -> None:
    anatomy = load_bench("bench_cell_anatomy")
    args = ["--cell", CELL.id, "--seed", "3", "--limit", "80", "--policy", "cost"]
    assert anatomy.main([*args, "--preset", "llama3-70b-h100-tp4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        f"{CELL.id} seed 3, 80 requests, pod model vllm (llama3-70b-h100-tp4), sessions closed"
    )
    assert "Whole run per pod, `cost`:" in out
    assert anatomy.main([*args, "--sessions", "open", "--pod-model", "simpod"]) == 0
    assert "pod model simpod, sessions open" in capsys.readouterr().out
