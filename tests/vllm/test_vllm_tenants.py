"""Live: two tenants through kvroute on two real vLLM CPU engines, the engines' own
``vllm:prefix_cache_hits_total`` the referee.

Opt-in (``pytest -m vllm tests/vllm -k tenants``).  vLLM 0.32 honours ``cache_salt`` on
the chat endpoint (``renderers/online_renderer.py`` passes it into the engine input,
``v1/core/kv_cache_utils.py`` puts it in block 0's extra keys), and the router sets it
to each tenant's HMAC.  So:

* tenant A's second turn hits A's cache on the engine that served its first;
* tenant B sending A's first prompt, on that same engine (a request id the router ranks
  it first for, found through ``/v1/route?tenant=b``; the room tie-break is off so that
  the request id places a prefix nobody holds), gets no hit at all; B's repeat
  then hits B's own cache (so a hit would have shown);
* a tenant's stream without ``include_usage`` is, through the router, the stream the
  engine sends such a client (ids and times aside), while its completion tokens are
  counted from the usage the router asked for.

The engines listen on HTTP ports 18100-18149 and ZMQ ports 18150+ (replay +100), a range
kept for this test so that it does not collide with other engines on the machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.tenants.rig import ADMIN, KEY_A, KEY_B, auth, sample, sha
from tests.vllm.test_vllm_routing import BLOCK, MODEL, _hits
from tools.capture_vllm_events import (
    VLLM_ROOT,
    EngineConfig,
    EngineProcess,
    EngineStartError,
    _port_is_free,
    missing_engine_reason,
)

pytestmark = pytest.mark.vllm

HTTP_PORTS = range(18100, 18150)
ZMQ_PORTS = range(18150, 18200)  # replay on port + 100


def _free(ports: range, taken: set[int], offset: int = 0) -> int:
    for port in ports:
        if (
            port not in taken
            and _port_is_free(port)
            and (not offset or _port_is_free(port + offset))
        ):
            taken.add(port)
            return port
    raise RuntimeError(f"no free port in {ports}")


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[EngineProcess]]:
    reason = missing_engine_reason()
    if reason:
        pytest.skip(reason)
    logs = tmp_path_factory.mktemp("vllm-tenants")
    taken: set[int] = set()
    procs = [
        EngineProcess(
            EngineConfig(hash_algo="sha256", env=(("OMP_NUM_THREADS", "1"),)),
            log_path=Path(logs) / f"tenants-{i}.log",
            http_port=_free(HTTP_PORTS, taken),
            zmq_port=_free(ZMQ_PORTS, taken, offset=100),
        )
        for i in range(2)
    ]
    try:
        for p in procs:
            p.start()
        for p in procs:
            try:
                p.wait_ready()
            except EngineStartError as exc:
                pytest.fail(f"vLLM engine did not start: {exc}")
        yield procs
    finally:
        for p in procs:
            p.stop()  # by PID, then its process group


@contextlib.asynccontextmanager
async def tenant_router(engines: list[EngineProcess]) -> AsyncIterator[httpx.AsyncClient]:
    from router.config import Settings
    from router.proxy.app import create_app
    from router.proxy.serve import RunningServer

    settings = Settings.model_validate(
        {
            "discovery": {
                "static": [
                    {
                        "name": f"vllm-{i}",
                        "url": e.base_url,
                        "events_endpoint": e.pub_endpoint,
                        "replay_endpoint": e.replay_endpoint,
                        "models": [MODEL],
                    }
                    for i, e in enumerate(engines)
                ]
            },
            "events": {"enabled": True, "mode": "dial"},
            "fleet": {"enabled": False},
            "tokenizers": {MODEL: str(VLLM_ROOT / "tiny-llama")},
            "block_size": BLOCK,
            "policy": "cost",
            # B's cold request is placed by request id alone (not by free room, which
            # would always send it away from the engine holding A's blocks)
            "policy_params": {"tie_break_by_room": False},
            "tenants": [
                {"name": "a", "key_sha256": sha(KEY_A)},
                {"name": "b", "key_sha256": sha(KEY_B)},
            ],
            "tenant_salt_secret": "x" * 40,
            "admin_key_sha256": [sha(ADMIN)],
        }
    )
    server = await RunningServer(create_app(settings)).start()
    client = httpx.AsyncClient(base_url=server.url, timeout=120)
    try:
        deadline = time.monotonic() + 60
        while (await client.get("/ready", headers=auth(ADMIN))).status_code != 200:
            assert time.monotonic() < deadline, "router never became ready"
            await asyncio.sleep(0.5)
        await asyncio.sleep(1.0)  # the SUB sockets finish connecting
        yield client
    finally:
        await client.aclose()
        await server.stop()


def _context() -> str:
    words = " ".join(f"ledger{i}" for i in range(150))
    return f"Confidential notes of tenant A: {words}."


def chat(messages: list[dict[str, str]], **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0, **kw}


async def _cached_blocks(router: httpx.AsyncClient, body: Any, tenant: str, pod: str) -> int:
    r = await router.post(f"/v1/route?tenant={tenant}", json=body, headers=auth(ADMIN))
    cand = {c["pod"]: c for c in r.json()["candidates"]}
    return int(cand.get(pod, {}).get("cached_blocks", {}).get("GPU", 0))


async def _wait_indexed(
    router: httpx.AsyncClient, body: Any, tenant: str, pod: str, n: int
) -> None:
    deadline = time.monotonic() + 30
    while await _cached_blocks(router, body, tenant, pod) < n:
        assert time.monotonic() < deadline, "the engine's events never reached the index"
        await asyncio.sleep(0.3)


async def _request_id_ranking_first(
    router: httpx.AsyncClient, body: Any, tenant: str, pod: str
) -> str:
    for i in range(300):
        rid = f"tenant-probe-{i}"
        r = await router.post(
            f"/v1/route?tenant={tenant}", json=body, headers={**auth(ADMIN), "x-request-id": rid}
        )
        if r.json()["candidates"][0]["pod"] == pod:
            return rid
    raise AssertionError(f"no request id ranks {pod} first for tenant {tenant}")


async def test_no_cross_tenant_hit_and_a_same_tenant_hit_on_real_engines(
    engines: list[EngineProcess],
) -> None:
    first = [{"role": "system", "content": _context()}, {"role": "user", "content": "Sum up."}]
    async with tenant_router(engines) as router:
        r = await router.post("/v1/chat/completions", json=chat(first), headers=auth(KEY_A))
        assert r.status_code == 200, r.text
        pod = r.headers["x-kvroute-pod"]
        holder = engines[int(pod.rsplit("-", 1)[1])]
        prompt_tokens = r.json()["usage"]["prompt_tokens"]
        full_blocks = (prompt_tokens - 1) // BLOCK

        # A's second turn: routed back to A's engine, which serves A's prefix from cache
        second = [
            *first,
            {"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And the total?"},
        ]
        await _wait_indexed(router, chat(second), "a", pod, full_blocks)
        before = await _hits(holder)
        r2 = await router.post("/v1/chat/completions", json=chat(second), headers=auth(KEY_A))
        assert r2.status_code == 200 and r2.headers["x-kvroute-pod"] == pod
        same_tenant_hit = await _hits(holder) - before
        assert same_tenant_hit >= full_blocks * BLOCK

        # B sends A's first prompt to the very engine that holds it: no hit at all
        assert await _cached_blocks(router, chat(first), "b", pod) == 0
        rid = await _request_id_ranking_first(router, chat(first), "b", pod)
        before_all = [await _hits(e) for e in engines]
        rb = await router.post(
            "/v1/chat/completions", json=chat(first), headers={**auth(KEY_B), "x-request-id": rid}
        )
        assert rb.status_code == 200 and rb.headers["x-kvroute-pod"] == pod
        cross = [await _hits(e) - b for e, b in zip(engines, before_all, strict=True)]
        assert cross == [0.0, 0.0]

        # B's repeat hits B's own cache: the referee counts hits when there are some
        await _wait_indexed(router, chat(first), "b", pod, full_blocks)
        before_b = await _hits(holder)
        rb2 = await router.post("/v1/chat/completions", json=chat(first), headers=auth(KEY_B))
        assert rb2.status_code == 200 and rb2.headers["x-kvroute-pod"] == pod
        own = await _hits(holder) - before_b
        assert own >= full_blocks * BLOCK
    print(
        f"\nprompt {prompt_tokens} tokens ({full_blocks} full blocks of {BLOCK}); "
        f"A's second turn hit {same_tenant_hit:.0f} tokens; B sending A's prompt to the same "
        f"engine hit {cross} tokens; B's repeat hit {own:.0f} tokens"
    )


_VOLATILE = re.compile(rb'"(id|created)":("[^"]*"|\d+)')


async def _stream(client: httpx.AsyncClient, url: str, body: Any, **kw: Any) -> bytes:
    async with client.stream("POST", url, json=body, **kw) as r:
        assert r.status_code == 200
        return b"".join([c async for c in r.aiter_raw()])


async def test_a_tenant_stream_without_include_usage_is_what_the_engine_sends_such_a_client(
    engines: list[EngineProcess],
) -> None:
    messages = [{"role": "user", "content": "Count to five."}]
    body = chat(messages, max_tokens=12, stream=True, ignore_eos=True)
    async with tenant_router(engines) as router, httpx.AsyncClient(timeout=120) as direct:
        got = await _stream(router, "/v1/chat/completions", body, headers=auth(KEY_A))
        expected = await _stream(direct, engines[0].base_url + "/v1/chat/completions", body)
        m = (await router.get("/metrics", headers=auth(ADMIN))).text
    assert b'"usage"' not in got and b'"system_fingerprint"' in expected
    assert _VOLATILE.sub(b"", got) == _VOLATILE.sub(b"", expected)
    completion = sample(m, "kvroute_tenant_tokens_total", tenant="a", kind="completion")
    assert completion == 12
    print(
        f"\nthe stream ({len(got)} bytes) equals the engine's; completion tokens {completion:.0f}"
    )
