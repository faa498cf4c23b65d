"""The simulated vLLM pod's metrics and its time model: vLLM's metric names, requests in
flight, aborts, time to first token, the queue behind max_batch.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx
import pytest

from router.sim import SimPod, SimSettings
from router.sim.engine import SimEngine, SimRequest
from tests.router.sim_pod_support import MakePod, Sub, metric, until
from tests.router.sim_pod_support import http as http  # the fixture
from tests.router.sim_pod_support import make_pod as make_pod  # the fixture
from tests.router.sim_pod_support import subscribe as subscribe  # the fixture


async def test_metrics_expose_vllm_names_labels_and_cache_config_info(
    make_pod: MakePod, http: httpx.AsyncClient
) -> None:
    pod = await make_pod(model="m", block_size=32, capacity_tokens=32 * 100)
    await http.post(f"{pod.url}/v1/completions", json={"model": "m", "prompt": "t" * 70})
    text = (await http.get(f"{pod.url}/metrics")).text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
    ):
        assert metric(text, name, model_name="m", engine="0") == 0
    assert metric(text, "vllm:time_to_first_token_seconds_count", model_name="m", engine="0") == 1
    assert metric(text, "vllm:request_queue_time_seconds_count", model_name="m", engine="0") == 1
    assert metric(text, "vllm:prefix_cache_queries_total", model_name="m") == 71
    assert metric(text, "vllm:request_success_total", finished_reason="length") == 1
    assert 'le="0.001"' in text and 'le="2560.0"' in text  # vLLM's TTFT buckets
    info = metric(
        text,
        "vllm:cache_config_info",
        block_size="32",
        num_gpu_blocks="100",
        kv_cache_size_tokens="3200",
        enable_prefix_caching="True",
        prefix_caching_hash_algo="sha256",
        engine="0",
    )
    assert info == 1
    # each pod has its own registry
    other = await make_pod(model="m2")
    assert "vllm:prefix_cache_queries_total" in (await http.get(f"{other.url}/metrics")).text
    assert 'model_name="m"' not in (await http.get(f"{other.url}/metrics")).text


async def test_waiting_and_running_and_kv_usage_follow_requests_in_flight(
    make_pod: MakePod, http: httpx.AsyncClient
) -> None:
    # prefill of ~64 tokens at 1 token/s: requests stay in flight until cancelled
    pod = await make_pod(time_scale=1.0, prefill_rate=1.0, block_size=16, capacity_tokens=16 * 40)
    url = f"{pod.url}/v1/completions"
    tasks = [
        asyncio.create_task(http.post(url, json={"prompt": c * 63, "max_tokens": 1})) for c in "abc"
    ]

    async def gauges() -> tuple[float, float, float]:
        text = (await http.get(f"{pod.url}/metrics")).text
        return (
            metric(text, "vllm:num_requests_running"),
            metric(text, "vllm:num_requests_waiting"),
            metric(text, "vllm:kv_cache_usage_perc"),
        )

    try:
        await until(lambda: (pod.engine.running, pod.engine.waiting) == (1, 2))
        # the scraped gauges say the same; 64 tokens of the running prompt = 4 of 40 blocks
        assert await gauges() == (1, 2, pytest.approx(4 / 40))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    # client aborts free the slot and the queue places
    await until(lambda: (pod.engine.running, pod.engine.waiting) == (0, 0))
    assert await gauges() == (0, 0, 0)


async def test_a_stream_closed_by_the_client_aborts_and_frees_its_slot(
    make_pod: MakePod, http: httpx.AsyncClient, subscribe: Callable[[SimPod], Awaitable[Sub]]
) -> None:
    # decode at 1 token/s: the stream would last ~100 s unless the abort works
    pod = await make_pod(time_scale=1.0, decode_rate=1.0, block_size=16)
    sub = await subscribe(pod)
    body = {"prompt": "v" * 40, "max_tokens": 100, "stream": True}
    async with http.stream("POST", f"{pod.url}/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                break  # the first token arrived; hang up
    (at_prefill,) = await sub.events()
    assert len(at_prefill["block_hashes"]) == 2
    await until(lambda: pod.engine.running == 0)
    text = (await http.get(f"{pod.url}/metrics")).text
    assert metric(text, "vllm:request_success_total", finished_reason="abort") == 1
    assert metric(text, "vllm:num_requests_running") == 0


async def test_ttft_is_queue_wait_plus_uncached_tokens_over_prefill_rate() -> None:
    """The time model, checked on the simulated delays it asks for (no clock)."""
    slept: list[float] = []

    async def record(seconds: float) -> None:
        slept.append(seconds)
        await asyncio.sleep(0)

    s = SimSettings(block_size=16, prefill_rate=1000.0, decode_rate=50.0, time_scale=2.0)
    engine = SimEngine(s, sleep=record)

    async def run(prompt: list[int], max_tokens: int) -> SimRequest:
        req = engine.prepare(SimRequest(prompt_ids=prompt, max_tokens=max_tokens))
        async for _ in engine.generate(req):
            pass
        return req

    prompt = list(range(100))  # 6 full blocks + 4
    await run(prompt, 3)
    # prefill 100 uncached tokens, then 2 decode steps; all x time_scale 2
    assert slept == [pytest.approx(2 * 100 / 1000), pytest.approx(2 / 50), pytest.approx(2 / 50)]
    slept.clear()
    req = await run(prompt + list(range(100, 120)), 1)
    assert req.cached_tokens == 96
    assert slept == [pytest.approx(2 * (120 - 96) / 1000)]


async def test_a_queue_forms_behind_max_batch_and_drains_in_order() -> None:
    gate = asyncio.Event()

    async def held(seconds: float) -> None:
        await gate.wait()

    engine = SimEngine(SimSettings(max_batch=1, time_scale=1.0), sleep=held)
    order: list[int] = []

    async def run(i: int) -> None:
        req = engine.prepare(SimRequest(prompt_ids=[i] * 20, max_tokens=2))
        async for _ in engine.generate(req):
            pass
        order.append(i)

    tasks = [asyncio.create_task(run(i)) for i in range(3)]
    await until(lambda: engine.waiting == 2)
    assert engine.running == 1
    gate.set()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2]
    assert (engine.running, engine.waiting) == (0, 0)
