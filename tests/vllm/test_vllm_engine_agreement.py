"""The engine model agrees with real vLLM: calibrate on a real engine, then one multi-turn
workload on real engines, the replay and ``kvroute sim`` (opt-in: ``pytest -m vllm``).

Runs ``tests/bench/bench_engine_agreement.py``'s pieces: two real vLLM CPU engines
(HTTP 18420-18421, ZMQ 18470-18471, replay 18570-18571) behind the router; engine 0 is
first calibrated (``kvroute calibrate``, its own random probes); then the validation
workload (seed 7, a different shape: shared system prompts, 4-turn chats) runs on the
engines, on the replay with the calibrated preset and on ``kvroute sim --pod-model vllm``
with it.  The issue's bounds: hit rate within 0.03 and TTFT p50 within 30% of the
replay's, for the real engines and for the sim.  Several minutes on 2 cores.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tools.capture_vllm_events import missing_engine_reason

pytestmark = pytest.mark.vllm

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_engine_agreement.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_engine_agreement", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


async def test_replay_real_engines_and_sim_agree_on_hit_rate_and_ttft(tmp_path: Path) -> None:
    reason = missing_engine_reason("tiny-llama")
    if reason:
        pytest.skip(reason)
    bench = _bench()
    reqs = bench.workload(bench.Shape(), seed=7)
    preset = tmp_path / "cpu-tiny-calibrated.json"
    outcomes = await bench.run_all(
        ["real", "replay", "sim"], preset, 2, "cost", reqs, tmp_path,
        calibrate=(11, 2, "fastest"), ports=(18420, 18470),
    )  # fmt: skip
    rows = {r["target"]: r for r in bench.compare(outcomes)}
    print(bench.table(list(rows.values())))
    for target in ("real", "sim"):
        row = rows[target]
        assert row["errors"] == 0, target
        assert abs(row["hit_rate_diff"]) <= 0.03, (target, row)
        assert abs(row["ttft_p50_ratio"] - 1) <= 0.30, (target, row)
