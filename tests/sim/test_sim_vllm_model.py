"""``kvroute sim --pod-model vllm``: the replay's vLLM engine model serving real HTTP.

Real HTTP over 127.0.0.1, a real ZMQ SUB for the KV events; delays off
(``time_scale=0``) except where the step times themselves are checked, and those
through a recording sleeper (no wall-clock assertions).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio
from pydantic import ValidationError

from router.sim import SimPod, SimSettings
from router.sim.engine import SimRequest
from router.sim.vllm_engine import VllmSimEngine
from scoring.replay.preset_file import spec_to_dict, write_preset_file
from scoring.replay.presets import EngineSpec
from scoring.replay.step_cost import StepCost, StepWork, prefill_pairs

GUARD = 10.0  # seconds: a failure guard, never a speed assertion
COST = StepCost(
    base_s=0.01, prefill_token_s=1e-4, prefill_pair_s=1e-8, decode_seq_s=1e-3,
    decode_context_token_s=1e-6,
)  # fmt: skip


def spec(**kw: Any) -> EngineSpec:
    base: dict[str, Any] = dict(
        name="test-engine", cost=COST, max_num_batched_tokens=256, max_num_seqs=4,
        max_model_len=4096, kv_capacity_tokens=4096,
    )  # fmt: skip
    base.update(kw)
    return EngineSpec(**base)


@pytest.fixture
def preset_file(tmp_path: Path) -> Path:
    path = tmp_path / "engine.json"
    write_preset_file(path, spec_to_dict(spec()))
    return path


MakePod = Callable[..., Awaitable[SimPod]]


@pytest.fixture
async def make_pod(preset_file: Path) -> AsyncIterator[MakePod]:
    pods: list[SimPod] = []

    async def make(**kw: Any) -> SimPod:
        kw.setdefault("time_scale", 0)
        kw.setdefault("pod_model", "vllm")
        kw.setdefault("preset_file", str(preset_file))
        kw.setdefault("block_size", 16)
        pod = SimPod(SimSettings(**kw))
        await pod.start()
        pods.append(pod)
        return pod

    yield make
    for pod in pods:
        await pod.stop()


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=GUARD) as client:
        yield client


async def complete(http: httpx.AsyncClient, pod: SimPod, prompt: list[int], n: int) -> Any:
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": n}
    r = await http.post(f"{pod.url}/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def metric(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rpartition(" ")[2])
    return total


async def test_a_chats_next_turn_hits_the_blocks_of_its_previous_answer(
    make_pod: MakePod, http: httpx.AsyncClient
) -> None:
    pod = await make_pod()
    prompt = list(range(1000, 1100))  # 100 tokens: 6 full blocks of 16
    first = await complete(http, pod, prompt, 40)
    answer = [ord(c) for c in first["choices"][0]["text"]]
    assert len(answer) == 40
    second = await complete(http, pod, prompt + answer + [7, 8, 9], 4)
    # prompt + answer[:-1] = 139 tokens have KV: 8 full blocks cached
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 8 * 16


async def test_the_published_events_track_the_engines_cache_through_evictions(
    make_pod: MakePod, http: httpx.AsyncClient
) -> None:
    pod = await make_pod(capacity_tokens=320)  # 20 blocks: the third prompt evicts
    assert pod.events_endpoint is not None
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(pod.events_endpoint)
    try:
        while True:  # the subscription is live once a probe arrives
            pod.reset_prefix_cache()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(sock.recv_multipart(), 0.1)
                break
        for base in (2000, 3000, 4000):
            await complete(http, pod, list(range(base, base + 150)), 20)
        copies: dict[int, int] = {}
        removed = 0
        assert pod.publisher is not None
        last = pod.publisher.next_seq - 1
        seq = -1
        while seq < last:
            _, raw_seq, payload = await asyncio.wait_for(sock.recv_multipart(), GUARD)
            seq = int.from_bytes(raw_seq, "big")
            for ev in msgspec.msgpack.decode(payload)[1]:
                if ev["type"] == "BlockStored":
                    for h in ev["block_hashes"]:
                        copies[h] = copies.get(h, 0) + 1
                elif ev["type"] == "BlockRemoved":
                    for h in ev["block_hashes"]:
                        removed += 1
                        copies[h] -= 1
                        if not copies[h]:
                            del copies[h]
                elif ev["type"] == "AllBlocksCleared":
                    copies.clear()
    finally:
        sock.close(linger=0)
    engine = pod.engine
    assert isinstance(engine, VllmSimEngine)
    mask = 2**64 - 1
    cached = {k & mask for k in engine.sched.pool._cached}
    assert removed > 0
    assert set(copies) == cached


async def test_metrics_count_hits_and_phases_as_vllm_does(
    make_pod: MakePod, http: httpx.AsyncClient
) -> None:
    pod = await make_pod()
    prompt = list(range(500, 580))
    await complete(http, pod, prompt, 5)
    again = await complete(http, pod, prompt, 5)
    text = (await http.get(f"{pod.url}/metrics")).text
    assert metric(text, "vllm:prefix_cache_queries_total") == 160
    assert metric(text, "vllm:prefix_cache_hits_total") == again["usage"]["prompt_tokens_details"][
        "cached_tokens"
    ] == 64  # fmt: skip
    for phase in ("queue", "prefill", "decode"):
        assert metric(text, f"vllm:request_{phase}_time_seconds_count") == 2
    assert metric(text, "vllm:kv_cache_usage_perc") == 0.0
    assert metric(text, "vllm:num_requests_running") == 0.0


async def test_each_step_sleeps_the_step_cost_of_what_it_computes(preset_file: Path) -> None:
    slept: list[float] = []

    async def record(s: float) -> None:
        slept.append(s)
        await asyncio.sleep(0)

    settings = SimSettings(
        pod_model="vllm", preset_file=str(preset_file), block_size=16, kv_events=False
    )
    engine = VllmSimEngine(settings, sleep=record)
    req = engine.prepare(SimRequest(prompt_ids=list(range(300)), max_tokens=3))
    out = [t async for t in engine.generate(req)]
    assert len(out) == 3
    # 300 prompt tokens in chunks of 256 + 44, then 2 decodes attending 301 and 302
    expected = [
        COST.seconds(StepWork(256, prefill_pairs(0, 256))),
        COST.seconds(StepWork(44, prefill_pairs(256, 44))),
        COST.seconds(StepWork(0, 0, 1, 301)),
        COST.seconds(StepWork(0, 0, 1, 302)),
    ]
    assert slept == pytest.approx(expected)
    assert req.ttft >= 0 and req.cached_tokens == 0


async def test_a_client_that_goes_away_frees_its_running_slot_and_blocks(
    make_pod: MakePod, http: httpx.AsyncClient
) -> None:
    pod = await make_pod(time_scale=1.0)
    body = {"model": "sim-model", "prompt": list(range(64)), "max_tokens": 1000, "stream": True}
    async with http.stream("POST", f"{pod.url}/v1/completions", json=body) as r:
        async for _ in r.aiter_lines():
            break
    engine = pod.engine
    assert isinstance(engine, VllmSimEngine)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + GUARD
    while engine.sched.has_work:
        assert loop.time() < deadline, "the aborted request stayed in the engine"
        await asyncio.sleep(0.01)
    assert engine.kv_usage() == 0.0


def test_the_vllm_model_refuses_pd_roles_and_simple_refuses_presets(preset_file: Path) -> None:
    with pytest.raises(ValidationError, match="role 'both' only"):
        SimSettings(pod_model="vllm", preset_file=str(preset_file), role="prefill")
    with pytest.raises(ValidationError, match="apply to pod_model 'vllm'"):
        SimSettings(preset="cpu-tiny")
    with pytest.raises(ValidationError, match="unknown preset"):
        SimSettings(pod_model="vllm", preset="no-such-engine")


def test_kvroute_sim_names_a_bad_preset_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    data = spec_to_dict(spec())
    data["cost"]["base_s"] = float("nan")
    bad.write_text(json.dumps(data))
    argv = ["sim", "--pod-model", "vllm", "--preset-file", str(bad)]
    proc = subprocess.run(
        [sys.executable, "-m", "router.cli", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "cost.base_s must be a finite number" in proc.stderr


async def test_the_presets_request_overhead_is_slept_before_the_request_is_scheduled(
    tmp_path: Path,
) -> None:
    slept: list[float] = []

    async def record(s: float) -> None:
        slept.append(s)
        await asyncio.sleep(0)

    path = tmp_path / "overhead.json"
    write_preset_file(path, spec_to_dict(spec(request_overhead_s=0.004)))
    settings = SimSettings(pod_model="vllm", preset_file=str(path), kv_events=False)
    engine = VllmSimEngine(settings, sleep=record)
    req = engine.prepare(SimRequest(prompt_ids=list(range(40)), max_tokens=1))
    assert len([t async for t in engine.generate(req)]) == 1
    assert slept == pytest.approx([0.004, COST.seconds(StepWork(40, prefill_pairs(0, 40)))])
