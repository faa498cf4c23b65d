"""Two tenants in front of simulated vLLM pods: keys, settings, clients."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import AsyncIterator
from typing import Any

import httpx

from router.config import Settings
from router.fleet.embedded import start_pods, static_pods, stop_pods
from router.proxy.app import create_app
from router.proxy.serve import RunningServer
from router.sim.pod import SimPod
from router.sim.settings import SimSettings

MODEL = "sim-model"
KEY_A = "key-of-tenant-a-0123456789"
KEY_B = "key-of-tenant-b-0123456789"
ADMIN = "admin-key-0123456789abcdef"
SECRET = "s" * 40


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def tenant(name: str, key: str, **kw: Any) -> dict[str, Any]:
    return {"name": name, "key_sha256": sha(key), **kw}


def two_tenants(**kw_a: Any) -> dict[str, Any]:
    """Settings overrides: tenants a and b, an admin key, the salt secret."""
    return {
        "tenants": [tenant("a", KEY_A, **kw_a), tenant("b", KEY_B)],
        "tenant_salt_secret": SECRET,
        "admin_key_sha256": [sha(ADMIN)],
    }


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def sim(i: int, **kw: Any) -> SimSettings:
    return SimSettings.model_validate(
        {"pod_name": f"sim-{i}", "time_scale": 0, "kv_events": False, "max_model_len": 8192, **kw}
    )


def settings_for(pods: list[SimPod], events: bool = False, **overrides: Any) -> Settings:
    return Settings.model_validate(
        {
            "discovery": {"static": [p.model_dump() for p in static_pods(pods)]},
            "events": {"enabled": events},
            "fleet": {"enabled": False},
            **overrides,
        }
    )


@contextlib.asynccontextmanager
async def router(settings: Settings) -> AsyncIterator[httpx.AsyncClient]:
    server = await RunningServer(create_app(settings)).start()
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            yield client
    finally:
        await server.stop()


@contextlib.asynccontextmanager
async def fleet(sims: list[SimSettings]) -> AsyncIterator[list[SimPod]]:
    pods = await start_pods(sims)
    try:
        yield pods
    finally:
        await stop_pods(pods)


def sample(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            head = line.split(" ", 1)[0]
            if head == name or head.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
    return total
