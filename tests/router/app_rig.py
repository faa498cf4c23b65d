"""A router in front of simulated vLLM pods over real loopback HTTP, for the tests of
the router's API (tests/router/test_app*.py and the answer tests that import it)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from router.config import Settings
from router.fleet.embedded import start_pods, static_pods, stop_pods
from router.proxy.app import create_app
from router.proxy.gateway import Gateway
from router.proxy.serve import RunningServer
from router.sim.pod import SimPod
from router.sim.settings import SimSettings

MODEL = "sim-model"


@dataclass
class Rig:
    pods: list[SimPod]
    router: RunningServer
    client: httpx.AsyncClient

    @property
    def gateway(self) -> Gateway:
        app: Any = self.router.server.config.app
        g: Gateway = app.state.gateway
        return g

    async def metrics(self) -> str:
        return (await self.client.get("/metrics")).text


@contextlib.asynccontextmanager
async def running(
    sims: list[SimSettings],
    events: bool = False,
    other_pods: tuple[dict[str, Any], ...] = (),
    **overrides: Any,
) -> AsyncIterator[Rig]:
    """Sim pods (and ``other_pods``, static entries of pods the test runs) and a router
    in front of them (static discovery), stopped on exit."""
    pods = await start_pods(sims)
    try:
        static = [*(p.model_dump() for p in static_pods(pods)), *other_pods]
        settings = Settings.model_validate(
            {
                "discovery": {"static": static},
                "events": {"enabled": events},
                "fleet": {"enabled": False},
                **overrides,
            }
        )
        router = await RunningServer(create_app(settings)).start()
        rig = Rig(pods, router, httpx.AsyncClient(base_url=router.url, timeout=30))
        try:
            yield rig
        finally:
            await rig.client.aclose()
            await router.stop()
    finally:
        await stop_pods(pods)


def sim(i: int, **kw: Any) -> SimSettings:
    return SimSettings.model_validate(
        {"pod_name": f"sim-{i}", "time_scale": 0, "kv_events": False, "max_model_len": 4096, **kw}
    )


def chat(content: str = "hello", **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}


async def assert_openai_error(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err: dict[str, Any] = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code
    assert err["message"]
    return err
