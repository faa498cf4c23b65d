"""Live: two real vLLM CPU engines behind the kvroute router.

Opt-in (``pytest -m vllm tests/vllm``).  Each engine is warmed with its own long prefix
*directly* (not through the router), so the router can only know where a prefix lives
from the engines' KV events.  Then a request that extends each prefix goes through the
router, and must land on the engine holding it:

* ``POST /v1/route`` names that engine and reports its cached blocks,
* the response's ``x-kvroute-pod`` header names it,
* that engine's own ``vllm:prefix_cache_hits_total`` rises by the shared prefix's
  tokens, and the other engine's does not move.

Uses ``router.proxy.app.create_app(Settings)`` with a static pod list (events dialled from
each engine's PUB socket, replay from its ROUTER socket), the engine's HF tokenizer
files for exact token ids, and block size 32.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.vllm.conftest import EngineFactory
from tools.capture_vllm_events import VLLM_ROOT, EngineProcess, free_port

pytestmark = pytest.mark.vllm

MODEL = "tiny-llama"
BLOCK = 32


def _prefix(topic: str) -> str:
    """A long, distinctive prefix (20-30 blocks) for one engine."""
    words = " ".join(f"{topic}{i}" for i in range(150))
    return f"Shared context about {topic}: {words}."


def _metric(text: str, name: str, pod: str | None = None) -> float:
    """A sample of ``name`` in a Prometheus exposition (the one labelled ``pod``)."""
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")) and (pod is None or f'pod="{pod}"' in line):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} (pod={pod}) missing from /metrics")


async def _hits(engine: EngineProcess) -> float:
    async with httpx.AsyncClient(timeout=10) as c:
        text = (await c.get(engine.base_url + "/metrics")).text
    return _metric(text, "vllm:prefix_cache_hits_total")


@pytest.fixture(scope="module")
def engines(engine: EngineFactory) -> list[EngineProcess]:
    return engine.many(["route-0", "route-1"], hash_algo="sha256")


def _pods(engines: list[EngineProcess], *, dial: bool = True) -> list[dict[str, Any]]:
    """Static pod entries ``vllm-<i>``; in bind mode the engines connect to us instead."""
    return [
        {
            "name": f"vllm-{i}",
            "url": e.base_url,
            "events_endpoint": e.pub_endpoint if dial else None,
            "replay_endpoint": e.replay_endpoint,
            "models": [MODEL],
        }
        for i, e in enumerate(engines)
    ]


@contextlib.asynccontextmanager
async def running_router(
    pods: list[dict[str, Any]],
    events: dict[str, Any] | None = None,
    policy_params: dict[str, Any] | None = None,
    **overrides: Any,
) -> AsyncIterator[httpx.AsyncClient]:
    """``kvroute`` (create_app + uvicorn on a free port, policy ``cost`` with
    ``policy_params``, more settings in ``overrides``) in front of ``pods``; yields a
    client once /ready answers 200."""
    from router.config import Settings
    from router.proxy.app import create_app
    from router.proxy.serve import RunningServer

    settings = Settings.model_validate(
        {
            "discovery": {"static": pods},
            "events": {"enabled": True, "mode": "dial", **(events or {})},
            "fleet": {"enabled": False},
            "tokenizers": {MODEL: str(VLLM_ROOT / "tiny-llama")},
            "block_size": BLOCK,
            "policy": "cost",
            "policy_params": policy_params or {},
            **overrides,
        }
    )
    server = await RunningServer(create_app(settings)).start()
    client = httpx.AsyncClient(base_url=server.url, timeout=120)
    try:
        deadline = time.monotonic() + 60
        while (await client.get("/ready")).status_code != 200:
            assert time.monotonic() < deadline, "router never became ready"
            await asyncio.sleep(0.5)
        await asyncio.sleep(1.0)  # let the SUB sockets finish connecting (slow joiner)
        yield client
    finally:
        await client.aclose()
        await server.stop()


@contextlib.asynccontextmanager
async def picker_behind_envoy(
    engines: list[EngineProcess],
) -> AsyncIterator[tuple[Any, httpx.AsyncClient]]:
    """`kvroute epp` (in process: policy ``cost``, the engines' KV events, their
    tokenizer) behind a real Envoy in front of ``engines``; yields the picker's
    :class:`router.epp.server.EppServer` and a client of Envoy."""
    from types import SimpleNamespace

    from router.config import Settings
    from tests.epp.fleet import epp_envoy

    settings = Settings.model_validate(
        {
            "discovery": {"static": _pods(engines)},
            "events": {"enabled": True, "mode": "dial"},
            "fleet": {"enabled": False},
            "tokenizers": {MODEL: str(VLLM_ROOT / "tiny-llama")},
            "block_size": BLOCK,
        }
    )
    pods = [SimpleNamespace(url=e.base_url) for e in engines]
    async with epp_envoy(pods, settings) as (server, client, _proxy):
        yield server, client


@pytest.fixture
async def router(engines: list[EngineProcess]) -> AsyncIterator[httpx.AsyncClient]:
    async with running_router(_pods(engines)) as client:
        yield client


async def _route(router: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
    r = await router.post("/v1/route", json=body)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


async def _wait_indexed(
    router: httpx.AsyncClient, body: dict[str, Any], pod: str, blocks: int
) -> dict[str, Any]:
    """Poll /v1/route until the router's index holds ``blocks`` leading blocks on ``pod``."""
    deadline = time.monotonic() + 30
    while True:
        plan = await _route(router, body)
        cand = {c["pod"]: c for c in plan["candidates"]}
        if cand.get(pod, {}).get("cached_blocks", {}).get("GPU", 0) >= blocks:
            return plan
        assert time.monotonic() < deadline, f"events never reached the index: {plan}"
        await asyncio.sleep(0.3)


async def test_a_request_extending_a_prefix_goes_to_the_engine_holding_it(
    engines: list[EngineProcess], router: httpx.AsyncClient
) -> None:
    prefixes = [_prefix("alpha"), _prefix("bravo")]
    # warm each engine with its own prefix, bypassing the router
    async with httpx.AsyncClient(timeout=120) as direct:
        for e, p in zip(engines, prefixes, strict=True):
            r = await direct.post(
                e.base_url + "/v1/completions",
                json={"model": MODEL, "prompt": p, "max_tokens": 1, "temperature": 0},
            )
            r.raise_for_status()
        warm_blocks = [
            len((await direct.post(e.base_url + "/tokenize", json={"prompt": p})).json()["tokens"])
            // BLOCK
            for e, p in zip(engines, prefixes, strict=True)
        ]
    for i, p in enumerate(prefixes):
        body = {"model": MODEL, "prompt": p + " Now answer the question.", "max_tokens": 2}
        holder, other = engines[i], engines[1 - i]
        plan = await _wait_indexed(router, body, f"vllm-{i}", warm_blocks[i])
        assert plan["pod"] == f"vllm-{i}", plan
        assert plan["block_size"] == BLOCK and not plan["approximate"]

        before = (await _hits(holder), await _hits(other))
        r = await router.post("/v1/completions", json={**body, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.headers["x-kvroute-pod"] == f"vllm-{i}"
        after = (await _hits(holder), await _hits(other))
        # the holder served the shared prefix from its cache (counters are in tokens)
        assert after[0] - before[0] >= (warm_blocks[i] - 1) * BLOCK
        assert after[1] == before[1]
    # the router ingested both engines' events, and understood all of them
    metrics = (await router.get("/metrics")).text
    for i in range(2):
        assert _metric(metrics, "kvroute_events_ingested_total", pod=f"vllm-{i}") > 0
        assert _metric(metrics, "kvroute_event_decode_errors_total", pod=f"vllm-{i}") == 0


async def test_chat_turns_through_the_router_stick_to_the_engine_that_served_the_first(
    engines: list[EngineProcess], router: httpx.AsyncClient
) -> None:
    system = _prefix("charlie")
    messages: list[dict[str, str]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": "First question?"},
    ]
    r = await router.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    first_pod = r.headers["x-kvroute-pod"]
    holder = engines[int(first_pod.rsplit("-", 1)[1])]
    answer = r.json()["choices"][0]["message"]["content"]
    messages += [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "A follow-up question?"},
    ]
    body = {"model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0}
    await _wait_indexed(router, body, first_pod, 10)
    before = await _hits(holder)
    r2 = await router.post("/v1/chat/completions", json=body)
    assert r2.status_code == 200, r2.text
    assert r2.headers["x-kvroute-pod"] == first_pod
    assert await _hits(holder) - before >= 10 * BLOCK


async def _complete_direct(engine: EngineProcess, prompt: str) -> int:
    """Send a completion straight to ``engine``; return its prompt's full blocks."""
    async with httpx.AsyncClient(base_url=engine.base_url, timeout=120) as direct:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        (await direct.post("/v1/completions", json=body)).raise_for_status()
        ids = (await direct.post("/tokenize", json={"prompt": prompt})).json()["tokens"]
    return len(ids) // BLOCK


async def test_a_router_joining_late_learns_earlier_blocks_from_the_engine_replay_buffer(
    engines: list[EngineProcess],
) -> None:
    """Blocks stored before the router existed are published at seq > 0 only once the
    engine's next batch arrives; the router then replays the engine's buffer (a real
    ROUTER socket) and indexes what it missed."""
    before = _prefix("delta")
    n = await _complete_direct(engines[1], before)  # published before the router listens
    async with running_router(_pods(engines)) as router:
        await _complete_direct(engines[1], _prefix("echo"))  # the first batch it sees
        body = {"model": MODEL, "prompt": before + " Question?", "max_tokens": 2}
        plan = await _wait_indexed(router, body, "vllm-1", n)
        assert plan["pod"] == "vllm-1"
        metrics = (await router.get("/metrics")).text
        assert _metric(metrics, "kvroute_event_replayed_batches_total", pod="vllm-1") >= 1


async def test_bind_mode_engines_connect_to_the_router_and_are_named_by_their_topic(
    engine: EngineFactory,
) -> None:
    """Engines given a non-wildcard endpoint *connect* their PUB socket to the router's
    bound SUB and publish under the topic ``kv@<pod>@<model>``."""
    port = free_port()
    replay_ports = [free_port(), free_port()]
    engines: list[tuple[str, dict[str, Any]]] = []
    for i, rport in enumerate(replay_ports):
        config = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{port}",  # no '*': the engine connects
            "replay_endpoint": f"tcp://*:{rport}",  # the replay ROUTER always binds
            "topic": f"kv@vllm-{i}@{MODEL}",
        }
        # vLLM warns "Found duplicate keys --kv-events-config" and keeps the last one,
        # so this replaces serve.sh's own config entirely
        extra = ("--kv-events-config", json.dumps(config))
        engines.append((f"bind-{i}", {"hash_algo": "sha256", "extra_args": extra}))
    procs = engine.group(engines)
    events = {"mode": "bind", "bind_endpoint": f"tcp://127.0.0.1:{port}"}
    pods = _pods(procs, dial=False)
    for pod, rport in zip(pods, replay_ports, strict=True):
        pod["replay_endpoint"] = f"tcp://127.0.0.1:{rport}"
    try:
        await _check_bind_mode(pods, events, procs)
    finally:
        engine.stop(*procs)


async def _check_bind_mode(
    pods: list[dict[str, Any]], events: dict[str, Any], procs: list[EngineProcess]
) -> None:
    async with running_router(pods, events) as router:
        n = await _complete_direct(procs[0], _prefix("foxtrot"))
        body = {"model": MODEL, "prompt": _prefix("foxtrot") + " Why?", "max_tokens": 2}
        plan = await _wait_indexed(router, body, "vllm-0", n)
        assert plan["pod"] == "vllm-0"
        r = await router.post("/v1/completions", json={**body, "temperature": 0})
        assert r.status_code == 200 and r.headers["x-kvroute-pod"] == "vllm-0"
        metrics = (await router.get("/metrics")).text
        assert _metric(metrics, "kvroute_events_ingested_total", pod="vllm-0") > 0
        assert _metric(metrics, "kvroute_event_bad_topics_total") == 0


async def test_the_engines_tokenize_and_detokenize_are_relayed_through_the_router(
    router: httpx.AsyncClient, engines: list[EngineProcess]
) -> None:
    """vLLM's other endpoints pass through: the router's answer is the engine's own."""
    body = {"model": MODEL, "prompt": "Relayed as it is."}
    r = await router.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    engine = engines[int(r.headers["x-kvroute-pod"].removeprefix("vllm-"))]
    async with httpx.AsyncClient(timeout=30) as direct:
        assert r.json() == (await direct.post(engine.base_url + "/tokenize", json=body)).json()
    tokens = r.json()["tokens"]
    back = await router.post("/detokenize", json={"model": MODEL, "tokens": tokens})
    assert back.status_code == 200, back.text
    assert "Relayed as it is." in back.json()["prompt"]


async def test_the_router_reads_each_engines_cache_size_from_its_metrics(
    engines: list[EngineProcess], router: httpx.AsyncClient
) -> None:
    """vLLM's ``vllm:cache_config_info`` carries ``num_gpu_blocks`` once the cache is
    sized: the room tie-break weighs free blocks with it."""
    import re

    plan = await _route(router, {"model": MODEL, "prompt": "how big is your cache?"})
    cand = {c["pod"]: c for c in plan["candidates"]}
    async with httpx.AsyncClient(timeout=10) as c:
        for i, e in enumerate(engines):
            text = (await c.get(e.base_url + "/metrics")).text
            found = re.search(r'vllm:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"', text)
            assert found, "the engine does not expose num_gpu_blocks"
            assert cand[f"vllm-{i}"]["capacity_blocks"] == int(found.group(1)) > 0
