"""The router (uvicorn on loopback) in front of one pod, with nothing else running:
no KV events, no embedded fleet, no health checks (tests run those themselves)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx

from router.config import Settings
from router.proxy.app import create_app
from router.proxy.gateway import Gateway
from router.proxy.serve import RunningServer


@contextlib.asynccontextmanager
async def one_pod_router(
    name: str, url: str, model: str, **settings: Any
) -> AsyncIterator[tuple[Gateway, httpx.AsyncClient]]:
    """Yield the gateway and a client of a router whose only pod is ``name`` at ``url``
    serving ``model``; ``settings`` are further top-level settings (``proxy={...}``)."""
    config = Settings.model_validate(
        {
            "discovery": {"static": [{"name": name, "url": url, "models": [model]}]},
            "events": {"enabled": False},
            "fleet": {"enabled": False},
            "health": {"enabled": False},
            **settings,
        }
    )
    app = create_app(config)
    async with (
        RunningServer(app) as router,
        httpx.AsyncClient(base_url=router.url, timeout=30) as client,
    ):
        yield app.state.gateway, client
