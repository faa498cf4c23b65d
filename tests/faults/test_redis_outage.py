"""Redis down is not the router down: with ``redis_url`` set, killing or freezing the
Redis-protocol server (a real valkey-server) while chats flow through the router gives
no 5xx and no hung request; requests are routed on the replica's own view
(``kvroute_redis_degraded`` 1, errors counted by op and kind) and the shared view comes
back by itself when the server does.

Real processes on loopback: 2 simulated vLLM pods (HTTP + ZMQ KV events), a real
valkey-server killed, restarted on the same port and frozen with SIGSTOP, the router on
a real socket.  No request may take longer than the client's deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from router.config import Settings
from router.fleet.embedded import start_pods, static_pods, stop_pods
from router.proxy.app import create_app
from router.proxy.serve import RunningServer
from router.sim.settings import SimSettings
from tests.support.aio import wait_until
from tests.support.redis_server import FaultyServer

MODEL = "sim-model"
#: a client's deadline per request: well past the router's Redis deadline (0.1 s) and
#: the pods' own answer time, far below the 600 s read timeout a hang would reach
CLIENT_DEADLINE_S = 10.0


@contextlib.asynccontextmanager
async def _rig(tmp_path: Path) -> AsyncIterator[tuple[FaultyServer, httpx.AsyncClient]]:
    sims = [
        SimSettings(pod_name=f"sim-{i}", model=MODEL, kv_events=True, time_scale=0)
        for i in range(2)
    ]
    pods = await start_pods(sims)
    server = FaultyServer(tmp_path)
    try:
        settings = Settings.model_validate(
            {
                "discovery": {"static": [p.model_dump() for p in static_pods(pods)]},
                "fleet": {"enabled": False},
                "redis_url": server.url,
                "index_writer": True,  # this replica also applies the events to Redis
                "redis_breaker_backoff_cap_s": 0.5,
            }
        )
        async with (
            RunningServer(create_app(settings)) as router,
            httpx.AsyncClient(base_url=router.url, timeout=CLIENT_DEADLINE_S) as client,
        ):
            yield server, client
    finally:
        server.stop()
        await stop_pods(pods)


async def _chats(client: httpx.AsyncClient, n: int, tag: str) -> list[int]:
    """``n`` concurrent chats (half streaming); their statuses. A hang raises."""

    async def one(i: int) -> int:
        body = {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": "You are terse. " * 20},
                {"role": "user", "content": f"{tag} question {i}"},
            ],
            "max_tokens": 8,
            "stream": i % 2 == 1,
        }
        r = await client.post("/v1/chat/completions", json=body)
        if body["stream"]:
            assert r.text.rstrip().endswith("data: [DONE]"), r.text[-200:]
        return r.status_code

    return list(await asyncio.gather(*(one(i) for i in range(n))))


def _gauge(text: str, name: str) -> float:
    m = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    assert m is not None, f"{name} not exported"
    return float(m.group(1))


def _errors(text: str) -> float:
    return sum(
        float(v) for v in re.findall(r"^kvroute_redis_errors_total\{[^}]*\} (\S+)$", text, re.M)
    )


async def _metrics(client: httpx.AsyncClient) -> str:
    return (await client.get("/metrics")).text


@pytest.mark.parametrize("fault", ["kill", "freeze"])
async def test_requests_are_answered_while_redis_is_down_and_the_shared_view_returns(
    tmp_path: Path, fault: str
) -> None:
    async with _rig(tmp_path) as (server, client):

        async def healthy() -> bool:
            await _chats(client, 2, "probe")  # requests are the breaker's probes
            return _gauge(await _metrics(client), "kvroute_redis_degraded") == 0.0

        assert set(await _chats(client, 8, "before")) == {200}
        # the shared view is up before the fault (on a slow machine the fresh server's
        # first calls can pass the 0.1 s deadline and trip the breaker: it closes again)
        await wait_until(healthy, "the shared view before the fault", timeout=20)

        server.kill() if fault == "kill" else server.freeze()
        for round_ in range(3):  # enough failures to open the breaker, then served open
            statuses = await _chats(client, 8, f"during-{round_}")
            assert set(statuses) == {200}, statuses
        text = await _metrics(client)
        assert _gauge(text, "kvroute_redis_degraded") == 1.0
        assert _errors(text) > 0

        server.restart() if fault == "kill" else server.thaw()

        await wait_until(healthy, "the breaker to close after Redis came back", timeout=20)
        assert set(await _chats(client, 8, "after")) == {200}
