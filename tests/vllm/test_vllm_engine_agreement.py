"""The engine model agrees with real vLLM: calibrate on real engines, then multi-turn
workloads on real engines, the replay and ``kvroute sim`` (opt-in: ``pytest -m vllm``).

Runs ``tests/bench/bench_engine_agreement.py``'s pieces: two real vLLM CPU engines (one
OpenMP thread each, niced below the router) behind the router.  Both engines run
``kvroute calibrate``'s random single-shape probes at once (seed 11, the median
repeat), engine 0's fit is the preset.  Then the validation workloads, which calibration
never saw — seed 7 and the held-out seed 13 (shared system prompts, 4-turn chats) on the
full 1 GiB caches, and a variant whose working set exceeds the cache (12 chats x 6 turns
on 64-block engines) — run on the engines, on the replay with the calibrated preset, and
on ``kvroute sim --pod-model vllm`` with it.  The issue's bounds: hit rate within 0.03
and TTFT p50 within 30% of the replay's, for the real engines and for the sim.  Ten
minutes or more on 2 shared cores; the TTFT bound is sensitive to the machine's load
(docs/replay.md, "Agreement with the real engine").
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.support.bench_module import load_bench
from tools.capture_vllm_events import missing_engine_reason

pytestmark = pytest.mark.vllm

PORTS = (18420, 18470)
FILL_BLOCKS = 64  # KV blocks per engine in the cache-filling variant


def _bench() -> ModuleType:
    return load_bench("bench_engine_agreement")


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    reason = missing_engine_reason("tiny-llama")
    if reason:
        pytest.skip(reason)
    return _bench()


@pytest.fixture(scope="module")
def calibrated(
    bench: ModuleType, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, dict[str, list[Any]]]:
    """The calibrated preset file, and seeds 7 and 13 on real engines, replay and sim."""
    tmp = tmp_path_factory.mktemp("agreement")
    preset = tmp / "cpu-tiny-calibrated.json"
    workloads = {f"seed {s}": bench.workload(bench.Shape(), seed=s) for s in (7, 13)}
    runs = bench.run_workloads(
        ["real", "replay", "sim"], preset, 2, "cost", workloads, tmp,
        calibrate=(11, 2, "median"), ports=PORTS,
    )  # fmt: skip
    return preset, asyncio.run(runs)


def _assert_agreement(bench: ModuleType, outcomes: list[Any]) -> dict[str, dict[str, Any]]:
    rows = {r["target"]: r for r in bench.compare(outcomes)}
    print(bench.table(list(rows.values())))
    for target in ("real", "sim"):
        row = rows[target]
        assert row["errors"] == 0, target
        assert abs(row["hit_rate_diff"]) <= 0.03, (target, row["hit_rate_diff"])
        assert abs(row["ttft_p50_ratio"] - 1) <= 0.30, (target, row["ttft_p50_ratio"])
    return rows


@pytest.mark.parametrize("seed", [7, 13])
def test_replay_real_engines_and_sim_agree_on_hit_rate_and_ttft(
    bench: ModuleType, calibrated: tuple[Path, dict[str, list[Any]]], seed: int
) -> None:
    _assert_agreement(bench, calibrated[1][f"seed {seed}"])


async def test_they_agree_when_the_working_set_exceeds_the_cache(
    bench: ModuleType, calibrated: tuple[Path, dict[str, list[Any]]], tmp_path: Path
) -> None:
    preset = calibrated[0]
    shape = bench.Shape(conversations=12, turns=6)
    reqs = bench.workload(shape, seed=7)
    setup = bench.EngineSetup(cache_blocks=FILL_BLOCKS)
    outcomes = await bench.run_all(
        ["real", "replay", "sim"], preset, 2, "cost", reqs, tmp_path, ports=PORTS, setup=setup
    )
    rows = _assert_agreement(bench, outcomes)
    # the caches did fill: the same workload on the full caches hits far more
    spec = bench.load_preset_file(preset)
    roomy = bench.run_replay(reqs, spec, 2, "cost")
    assert rows["replay"]["hit_rate"] < roomy.hit_rate - 0.1, (rows["replay"], roomy.hit_rate)
