"""The health checks' panic threshold with real hung pods: three `kvroute sim` processes
frozen by SIGSTOP (their sockets stay open: health checks time out, nothing is refused).

* One frozen pod of three is ejected as before: the two others stay above the
  threshold (50%), requests go to them.
* All three frozen: ejecting them would leave the model no pod, so none is ejected
  (``kvroute_health_panic{model}`` 1).  Requests still go to the pods and end cleanly:
  a stream fails over once at its first-byte deadline, then answers 504; a
  non-streaming request answers 504 at its read timeout.  Never an instant 503 "no
  healthy pod".  Once the pods answer again the panic ends.

The router runs in this process (uvicorn); only "ends before the client's own timeout"
and "not before the deadline it names" are timed.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from router.config import Settings
from router.proxy.app import create_app
from router.proxy.gateway import Gateway
from router.proxy.serve import RunningServer
from tests.support.aio import wait_until
from tests.support.sim_process import SimProcess, sim_processes

MODEL = "panic-model"
FIRST_BYTE_S = 1.0
READ_S = 2.0
CLIENT_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def pods() -> Iterator[dict[str, SimProcess]]:
    with sim_processes(["a", "b", "c"], MODEL, "--time-scale", "0.1") as started:
        yield started


@contextlib.asynccontextmanager
async def router(pods: dict[str, SimProcess]) -> AsyncIterator[tuple[Gateway, httpx.AsyncClient]]:
    settings = Settings.model_validate(
        {
            "discovery": {
                "static": [{"name": n, "url": p.url, "models": [MODEL]} for n, p in pods.items()]
            },
            "events": {"enabled": False},
            "fleet": {"enabled": False},
            "health": {"interval_s": 0.2, "timeout_s": 0.3, "failure_threshold": 2},
            "proxy": {"first_byte_timeout_s": FIRST_BYTE_S, "read_timeout_s": READ_S},
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


def body(stream: bool) -> dict[str, Any]:
    return {"model": MODEL, "prompt": [5] * 16, "max_tokens": 4, "stream": stream}


def panic(gateway: Gateway) -> float | None:
    return gateway.metrics.registry.get_sample_value("kvroute_health_panic", {"model": MODEL})


def healthy(gateway: Gateway) -> list[str]:
    return sorted(p.name for p in gateway.registry.all() if p.healthy)


def failing(gateway: Gateway, n: int) -> bool:
    """Every pod has failed at least ``n`` checks in a row."""
    return all(p.consecutive_failures >= n for p in gateway.registry.all())


async def test_one_frozen_pod_of_three_is_ejected_and_the_others_serve(
    pods: dict[str, SimProcess],
) -> None:
    async with router(pods) as (gateway, client):
        await wait_until(lambda: panic(gateway) == 0.0)
        pods["c"].stop_process()
        await wait_until(lambda: healthy(gateway) == ["a", "b"], timeout=10)
        assert panic(gateway) == 0.0
        for stream in (False, True):
            r = await client.post("/v1/completions", json=body(stream))
            assert r.status_code == 200, r.text
            assert r.headers["x-kvroute-pod"] in ("a", "b")
        pods["c"].resume()
        await wait_until(lambda: healthy(gateway) == ["a", "b", "c"], timeout=10)


async def test_with_every_pod_frozen_none_is_ejected_and_requests_time_out_cleanly(
    pods: dict[str, SimProcess],
) -> None:
    async with router(pods) as (gateway, client):
        await wait_until(lambda: healthy(gateway) == ["a", "b", "c"])
        for p in pods.values():
            p.stop_process()
        await wait_until(lambda: failing(gateway, 4), timeout=15)
        assert healthy(gateway) == ["a", "b", "c"]  # in rotation: a panic, not "no pod"
        assert panic(gateway) == 1.0

        t0 = time.monotonic()
        r = await client.post("/v1/completions", json=body(stream=True))
        took = time.monotonic() - t0
        assert r.status_code == 504, r.text  # one failover, then the deadline it names
        assert "proxy.first_byte_timeout_s" in r.json()["error"]["message"]
        assert took >= 2 * FIRST_BYTE_S  # it waited on two pods: it was not refused at once

        t0 = time.monotonic()
        r = await client.post("/v1/completions", json=body(stream=False))
        took = time.monotonic() - t0
        assert r.status_code == 504, r.text
        assert r.json()["error"]["message"]
        assert took >= READ_S

        for p in pods.values():
            p.resume()
        # the panic ends as soon as enough pods answer again; a pod whose last checks timed
        # out may be ejected for a round before its next check puts it back
        await wait_until(
            lambda: panic(gateway) == 0.0 and healthy(gateway) == ["a", "b", "c"], timeout=15
        )
        r = await client.post("/v1/completions", json=body(stream=False))
        assert r.status_code == 200, r.text
