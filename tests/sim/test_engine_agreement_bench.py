"""The engine-agreement bench's engine-free parts: what the engines are started with, that
the replay mirrors it, and the comparison it reports (the live parts: ``pytest -m vllm
tests/vllm/test_vllm_engine_agreement.py``)."""

from __future__ import annotations

import math
from types import ModuleType

import pytest

from scoring.replay.presets import PRESETS
from tests.support.bench_module import load_bench


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return load_bench("bench_engine_agreement", "bench_engine_agreement_parts")


def test_engines_run_one_openmp_thread_and_a_small_cache_when_asked(bench: ModuleType) -> None:
    roomy = bench.EngineSetup()
    assert roomy.env() == {"OMP_NUM_THREADS": "1"}
    assert roomy.serve_args() == []
    small = bench.EngineSetup(cache_blocks=64)
    # vLLM refuses max_model_len = the whole cache: one block to spare
    assert small.serve_args() == ["--num-gpu-blocks-override", "64", "--max-model-len", "2016"]
    spec = small.engine_spec(PRESETS["cpu-tiny"])
    assert (spec.kv_capacity_tokens, spec.max_model_len) == (2048, 2016)
    assert bench.EngineSetup(omp_threads=None).env() == {}


def test_the_cache_filling_variant_does_fill_the_replays_caches(bench: ModuleType) -> None:
    reqs = bench.workload(bench.Shape(conversations=12, turns=6), seed=7)
    base = PRESETS["cpu-tiny"]
    roomy = bench.run_replay(reqs, base, 2, "cost")
    full = bench.run_replay(reqs, bench.EngineSetup(cache_blocks=64).engine_spec(base), 2, "cost")
    assert full.errors == roomy.errors == 0
    assert full.hit_rate < roomy.hit_rate - 0.1
    assert len(full.ttft_s) == len(reqs) and all(t > 0 for t in full.ttft_s)


def test_live_ttft_is_compared_with_the_replays_request_by_request(bench: ModuleType) -> None:
    replay = bench.Outcome("replay", 0.5, 0.1, 0.2, 3, 0, ttft_s=[0.1, 0.2, 0.4])
    real = bench.Outcome("real", 0.52, 0.3, 0.5, 3, 1, ttft_s=[0.2, math.nan, 1.2])
    rows = {r["target"]: r for r in bench.compare([replay, real])}
    assert rows["real"]["hit_rate_diff"] == pytest.approx(0.02)
    assert rows["real"]["ttft_p50_ratio"] == pytest.approx(3.0)
    assert rows["real"]["per_request_ratio_p50"] == pytest.approx(2.5)  # median of 2, 3
    assert "per_request_ratio_p50" not in rows["replay"]
    assert "| real | 0.520 |" in bench.table(list(rows.values()))


def test_engine_means_come_from_the_pods_histogram_deltas(bench: ModuleType) -> None:
    deltas = {
        "vllm:time_to_first_token_seconds_count": 4,
        "vllm:time_to_first_token_seconds_sum": 0.4,
        "vllm:request_queue_time_seconds_sum": 0.04,
        "vllm:request_prefill_time_seconds_sum": 0.2,
        "vllm:generation_tokens_total": 64,
        "vllm:request_decode_time_seconds_count": 4,
        "vllm:request_decode_time_seconds_sum": 0.6,
    }
    means = bench.engine_means(lambda name: deltas.get(name, 0.0))
    assert means == pytest.approx(
        {"ttft_mean_s": 0.1, "queue_mean_s": 0.01, "prefill_mean_s": 0.05,
         "decode_per_token_s": 0.01}  # 60 tokens after the first of each request
    )  # fmt: skip
    assert bench.engine_means(lambda name: 0.0) == {}
