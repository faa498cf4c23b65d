"""Failover of requests stalled before their first byte: a hung pod (SIGSTOP), a pod
ejected by health checks or dropped by discovery while requests wait on it, and the
first-byte deadline of streams.  Never a re-send once a byte reached the client, and at
most one failover per request.

Real processes on loopback: three `kvroute sim` pods (a prefill of 20 tokens/s, so a
40-token prompt takes 2 s before its first byte; SIGSTOP makes a pod hang with its
sockets open) and the router (uvicorn) in this process.  No timing is asserted beyond
"answers before the client's own timeout".
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from router.config import Settings
from router.fleet.pods import PodSpec
from router.proxy.app import create_app
from router.proxy.gateway import Gateway
from router.proxy.serve import RunningServer
from tests.support.aio import wait_until
from tests.support.sim_process import SimProcess, sim_processes

MODEL = "fo-model"
#: 40 token ids: 2 s of prefill at 20 tokens/s before the first byte
PROMPT = [7] * 40
CLIENT_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def pods() -> Iterator[dict[str, SimProcess]]:
    args = ("--time-scale", "1", "--prefill-rate", "20", "--decode-rate", "50")
    with sim_processes(["a", "b", "c"], MODEL, *args) as started:
        yield started


@contextlib.asynccontextmanager
async def router(
    pods: dict[str, SimProcess], **overrides: Any
) -> AsyncIterator[tuple[Gateway, httpx.AsyncClient]]:
    settings = Settings.model_validate(
        {
            "discovery": {
                "static": [{"name": n, "url": p.url, "models": [MODEL]} for n, p in pods.items()]
            },
            "events": {"enabled": False},
            "fleet": {"enabled": False},
            "health": {"enabled": False},
            **overrides,
        }
    )
    app = create_app(settings)
    try:
        async with (
            RunningServer(app) as server,
            httpx.AsyncClient(base_url=server.url, timeout=CLIENT_TIMEOUT_S) as client,
        ):
            yield app.state.gateway, client
    finally:
        for p in pods.values():
            p.resume()  # a test that failed half-way leaves no pod stopped


def body(stream: bool, max_tokens: int = 8) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "stream": stream}


async def request_id_ranked(client: httpx.AsyncClient, order: list[str], b: dict[str, Any]) -> str:
    """A request id the policy ranks ``order`` first (decisions are deterministic)."""
    for i in range(500):
        rid = f"req-{i}"
        r = await client.post("/v1/route", json=b, headers={"x-request-id": rid})
        ranking = [c["pod"] for c in r.json()["candidates"]]
        if ranking[: len(order)] == order:
            return rid
    raise AssertionError(f"no request id ranks {order} first")


def sample(gateway: Gateway, name: str, **labels: str) -> float:
    value = gateway.metrics.registry.get_sample_value(name, labels)
    return value or 0.0


async def until_busy(pod: SimProcess) -> None:
    async def busy() -> bool:
        return await pod.busy() > 0

    await wait_until(busy, timeout=20)


async def test_a_stream_on_a_pod_sigstopped_mid_request_completes_on_the_next_pod(
    pods: dict[str, SimProcess],
) -> None:
    async with router(pods, proxy={"first_byte_timeout_s": 5.0}) as (gateway, client):
        b = body(stream=True)
        rid = await request_id_ranked(client, ["a", "b"], b)
        call = asyncio.create_task(
            client.post("/v1/completions", json=b, headers={"x-request-id": rid})
        )
        await until_busy(pods["a"])  # the request is in its prefill on a
        pods["a"].stop_process()
        r = await call
        assert r.status_code == 200, r.text
        assert r.headers["x-kvroute-pod"] == "b"
        assert r.text.rstrip().endswith("data: [DONE]")
        assert sample(gateway, "kvroute_retries_total", reason="first_byte_timeout") == 1
        assert (
            sample(gateway, "kvroute_upstream_errors_total", pod="a", reason="first_byte_timeout")
            == 1
        )


async def test_a_request_waiting_on_a_pod_that_health_checks_eject_is_rerouted(
    pods: dict[str, SimProcess],
) -> None:
    health = {"interval_s": 0.2, "timeout_s": 0.5, "failure_threshold": 2}
    async with router(pods, health=health) as (gateway, client):
        b = body(stream=False)
        rid = await request_id_ranked(client, ["a", "b"], b)
        call = asyncio.create_task(
            client.post("/v1/completions", json=b, headers={"x-request-id": rid})
        )
        await until_busy(pods["a"])
        pods["a"].stop_process()  # health checks time out on it, then eject it
        r = await call
        assert r.status_code == 200, r.text
        assert r.headers["x-kvroute-pod"] == "b"
        assert r.json()["choices"][0]["text"]
        assert sample(gateway, "kvroute_retries_total", reason="pod_ejected") == 1
        state = gateway.registry.get("a")
        assert state is not None and not state.healthy


async def test_a_request_waiting_on_a_pod_that_leaves_the_fleet_is_rerouted(
    pods: dict[str, SimProcess],
) -> None:
    async with router(pods) as (gateway, client):
        b = body(stream=False)
        rid = await request_id_ranked(client, ["a", "b"], b)
        call = asyncio.create_task(
            client.post("/v1/completions", json=b, headers={"x-request-id": rid})
        )
        await until_busy(pods["a"])
        gateway.registry.set_pods(
            PodSpec(name=n, url=p.url, models=(MODEL,)) for n, p in pods.items() if n != "a"
        )
        r = await call
        assert r.status_code == 200, r.text
        assert r.headers["x-kvroute-pod"] == "b"
        assert sample(gateway, "kvroute_retries_total", reason="pod_removed") == 1
        # the cancelled request was aborted on a (its connection closed)
        await until_idle(pods["a"])


async def until_idle(pod: SimProcess) -> None:
    async def idle() -> bool:
        return await pod.busy() == 0

    await wait_until(idle, timeout=20)


async def test_a_stream_that_already_sent_bytes_is_not_resent_when_its_pod_is_ejected(
    pods: dict[str, SimProcess],
) -> None:
    async with router(pods, proxy={"first_byte_timeout_s": 5.0}) as (gateway, client):
        b = body(stream=True, max_tokens=60)  # 2 s of prefill, then 1.2 s of tokens
        rid = await request_id_ranked(client, ["a", "b"], b)
        seen = {n: await p.requests_seen() for n, p in pods.items()}
        chunks: list[bytes] = []
        async with client.stream(
            "POST", "/v1/completions", json=b, headers={"x-request-id": rid}
        ) as r:
            assert r.headers["x-kvroute-pod"] == "a"
            async for chunk in r.aiter_raw():
                if not chunks:  # bytes reached the client: a goes away now
                    state = gateway.registry.get("a")
                    assert state is not None
                    gateway.registry.set_healthy(state, False)
                    gateway.registry.set_pods(
                        PodSpec(name=n, url=p.url, models=(MODEL,))
                        for n, p in pods.items()
                        if n != "a"
                    )
                chunks.append(chunk)
        text = b"".join(chunks).decode()
        assert text.rstrip().endswith("data: [DONE]")
        assert text.count('"text"') == 60  # every token, from a alone
        assert {n: await p.requests_seen() for n, p in pods.items()} == {
            **seen,
            "a": seen["a"] + 1,
        }
        assert sample(gateway, "kvroute_retries_total", reason="pod_ejected") == 0
        assert sample(gateway, "kvroute_retries_total", reason="pod_removed") == 0


async def test_a_stream_that_sent_bytes_ends_when_its_ejected_pod_goes_silent(
    pods: dict[str, SimProcess],
) -> None:
    # vLLM shut down with SIGTERM keeps its connections open and silent: a stream that
    # is already relaying must end at proxy.ejected_stream_idle_s, not read_timeout_s
    proxy = {"first_byte_timeout_s": 5.0, "ejected_stream_idle_s": 1.0}
    async with router(pods, proxy=proxy) as (gateway, client):
        b = body(stream=True, max_tokens=500)  # 10 s of tokens
        rid = await request_id_ranked(client, ["a", "b"], b)
        chunks: list[bytes] = []
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(httpx.RemoteProtocolError):  # the response ends unfinished
            async with client.stream(
                "POST", "/v1/completions", json=b, headers={"x-request-id": rid}, timeout=20
            ) as r:
                assert r.headers["x-kvroute-pod"] == "a"
                async for chunk in r.aiter_raw():
                    if not chunks:  # bytes reached the client: a hangs, then is ejected
                        pods["a"].stop_process()
                        state = gateway.registry.get("a")
                        assert state is not None
                        gateway.registry.set_healthy(state, False)
                    chunks.append(chunk)
        assert asyncio.get_running_loop().time() - t0 < 20  # not the 600 s read timeout
        assert chunks and not b"".join(chunks).rstrip().endswith(b"data: [DONE]")
        assert sample(gateway, "kvroute_upstream_errors_total", pod="a", reason="stream_broken")
        assert sample(gateway, "kvroute_retries_total", reason="pod_ejected") == 0


async def test_a_request_is_rerouted_at_most_once(pods: dict[str, SimProcess]) -> None:
    settings = {"proxy": {"first_byte_timeout_s": 1.5, "retries": 2}}
    async with router(pods, **settings) as (gateway, client):
        b = body(stream=True)
        rid = await request_id_ranked(client, ["a", "b", "c"], b)
        seen_c = await pods["c"].requests_seen()
        pods["a"].stop_process()
        pods["b"].stop_process()
        r = await client.post("/v1/completions", json=b, headers={"x-request-id": rid})
        assert r.status_code == 504, r.text
        error = r.json()["error"]
        assert error["code"] == "first_byte_timeout"
        assert "pod b sent no first byte within 1.5 s" in error["message"]
        assert r.headers["x-kvroute-pod"] == "b"
        assert sample(gateway, "kvroute_retries_total", reason="first_byte_timeout") == 1
        assert await pods["c"].requests_seen() == seen_c  # a third pod was never tried


async def test_the_first_byte_deadline_does_not_apply_to_non_streaming_requests(
    pods: dict[str, SimProcess],
) -> None:
    async with router(pods, proxy={"first_byte_timeout_s": 0.5}) as (gateway, client):
        b = body(stream=False)  # 2 s before its answer, far past the deadline
        rid = await request_id_ranked(client, ["a", "b"], b)
        r = await client.post("/v1/completions", json=b, headers={"x-request-id": rid})
        assert r.status_code == 200, r.text
        assert r.headers["x-kvroute-pod"] == "a"
        assert sample(gateway, "kvroute_retries_total", reason="first_byte_timeout") == 0


async def test_without_a_next_pod_a_stalled_stream_answers_504_naming_the_deadline(
    pods: dict[str, SimProcess],
) -> None:
    settings = {"proxy": {"first_byte_timeout_s": 1.0, "retries": 0}}
    async with router(pods, **settings) as (gateway, client):
        b = body(stream=True)
        rid = await request_id_ranked(client, ["a"], b)
        pods["a"].stop_process()
        r = await client.post("/v1/completions", json=b, headers={"x-request-id": rid})
        assert r.status_code == 504
        assert "proxy.first_byte_timeout_s" in r.json()["error"]["message"]
        assert sample(gateway, "kvroute_retries_total", reason="first_byte_timeout") == 0
