"""Kubernetes discovery helpers of the ``test_discovery_*.py`` files (and of
``test_tls.py`` and ``test_pod_roles.py``): Pod objects as the API server returns them, a
small fake API server (FastAPI on uvicorn, loopback, a free port) serving the Pods list
and a watch stream of JSON lines the test feeds, and a running K8sDiscovery.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from router.fleet.discovery import (
    K8sDiscovery,
    K8sDiscoverySettings,
)
from router.fleet.pods import PodRegistry
from tests.support.aio import running, serve_app


def k8s_pod(
    name: str,
    ip: str | None = "10.0.0.1",
    ready: bool = True,
    annotations: dict[str, str] | None = None,
    rv: str = "1",
) -> dict[str, Any]:
    status: dict[str, Any] = {
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]
    }
    if ip:
        status["podIP"] = ip
    return {
        "metadata": {
            "name": name,
            "resourceVersion": rv,
            "annotations": annotations or {},
        },
        "status": status,
    }


class FakeApiServer:
    """The two Pod endpoints of a Kubernetes API server, scripted by the test."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.list_rv = "100"
        self.watch_queue: asyncio.Queue[dict[str, Any] | str | None] = asyncio.Queue()
        self.requests: list[dict[str, Any]] = []
        self.gone_on_next_watch = False
        app = FastAPI()

        @app.get("/api/v1/namespaces/{ns}/pods")
        async def pods(ns: str, request: Request) -> Any:
            q = dict(request.query_params)
            self.requests.append(
                {"ns": ns, "query": q, "auth": request.headers.get("authorization")}
            )
            if q.get("watch") not in ("1", "true"):
                return {
                    "kind": "PodList",
                    "metadata": {"resourceVersion": self.list_rv},
                    "items": self.items,
                }
            if self.gone_on_next_watch:
                self.gone_on_next_watch = False
                return JSONResponse({"kind": "Status", "code": 410}, status_code=410)

            async def lines() -> AsyncIterator[bytes]:
                while True:
                    ev = await self.watch_queue.get()
                    if ev is None:  # end this watch stream (server-side timeout)
                        return
                    line = ev if isinstance(ev, str) else json.dumps(ev)
                    yield (line + "\n").encode()

            return StreamingResponse(lines(), media_type="application/json")

        self.app = app

    def watches(self) -> list[dict[str, Any]]:
        return [r for r in self.requests if r["query"].get("watch")]

    def lists(self) -> list[dict[str, Any]]:
        return [r for r in self.requests if not r["query"].get("watch")]


def k8s_settings(url: str, tmp_path: Path, **kw: Any) -> K8sDiscoverySettings:
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    return K8sDiscoverySettings(
        namespace="llm",
        label_selector="app=vllm",
        api_server=url,
        token_file=str(token),
        events_port=5557,
        retry_s=0.05,
        **kw,
    )


@contextlib.asynccontextmanager
async def k8s_discovery_running(
    api: FakeApiServer, tmp_path: Path, **kw: Any
) -> AsyncIterator[tuple[K8sDiscovery, PodRegistry]]:
    """Serve ``api`` on loopback and run a K8sDiscovery (``kw``: its settings) against it
    for the block."""
    async with serve_app(api.app) as url:
        disc = K8sDiscovery(k8s_settings(url, tmp_path, **kw))
        reg = PodRegistry()
        async with running(disc.run(reg)):
            yield disc, reg
