"""The EPP's servers: Envoy's ext_proc ``ExternalProcessor`` and gRPC health on one
gRPC port (asyncio), ``/metrics`` and ``/health`` over HTTP on another.

Health (the gRPC Health Checking Protocol, as GIE's protocol asks):

* ``liveness`` — SERVING while the process answers;
* ``readiness`` and ``envoy.service.ext_proc.v3.ExternalProcessor`` — SERVING once
  the core has started (discovery ran, the first health round of the pods and the
  first scrape are done, the KV-event subscriber is up), NOT_SERVING before and while
  shutting down;
* ``""`` (the server as a whole) — as readiness.

Readiness does not follow the pods' health, as GIE's picker's does not: with no pod
ready the picker still answers, with the protocol's 503, where a NOT_SERVING picker
would be skipped by the proxy (its failure mode then decides: see docs/gateway.md).
``/health`` over HTTP answers ``{"status": "ok", "ready": ..., "healthy_pods": ...}``:
``ready`` is :meth:`RouterCore.ready` (>= 1 healthy pod per model), for a human.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator
from typing import Any

import uvicorn

from router.epp.fronts import EXT_PROC_SERVICE, NOT_SERVING, SERVING, make_front
from router.epp.picker import EndpointPicker
from router.metrics import CONTENT_TYPE

log = logging.getLogger(__name__)

READY_SERVICES = ("", "readiness", EXT_PROC_SERVICE)


class EppServer:
    """The gRPC server (ext_proc + health) and the HTTP server (metrics) of one picker;
    ``grpc_server``: ``h2`` or ``grpcio`` (:mod:`router.epp.fronts`)."""

    def __init__(
        self,
        picker: EndpointPicker,
        *,
        grpc_host: str = "127.0.0.1",
        grpc_port: int = 9002,
        metrics_host: str = "127.0.0.1",
        metrics_port: int = 9090,
        grpc_server: str = "h2",
    ) -> None:
        self.picker = picker
        self.grpc_host = grpc_host
        self.front = make_front(grpc_server, picker, grpc_host, grpc_port)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((metrics_host, metrics_port))
        self.metrics_url = "http://{}:{}".format(*self._sock.getsockname()[:2])
        self._http: Any = None
        self._tasks: list[asyncio.Task[Any]] = []
        self.ready = False

    @property
    def grpc_port(self) -> int:
        """The gRPC port (a port asked as 0 is known once started)."""
        return self.front.port

    @property
    def grpc_address(self) -> str:
        return f"{self.grpc_host}:{self.grpc_port}"

    def _http_app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.requests import Request
        from starlette.responses import JSONResponse, Response
        from starlette.routing import Route

        picker = self.picker

        async def metrics(request: Request) -> Response:
            return Response(picker.metrics.render(), media_type=CONTENT_TYPE)

        async def health(request: Request) -> Response:
            ok, pods = picker.ready()
            return JSONResponse({"status": "ok", "ready": ok, "healthy_pods": pods})

        return Starlette(
            routes=[
                Route("/metrics", metrics),
                Route("/health", health),
            ]
        )

    async def start(self) -> None:
        """Start the picker's core, then serve (readiness follows the fleet)."""
        await self.front.set_health("liveness", SERVING)
        await self._set_ready(False)
        await self.picker.start()
        await self.front.start()
        config = uvicorn.Config(
            self._http_app(), log_level="warning", lifespan="off", access_log=False
        )
        self._http = _QuietServer(config)
        task = asyncio.create_task(self._http.serve(sockets=[self._sock]), name="epp-http")
        self._tasks.append(task)
        while not self._http.started:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
        await self._set_ready(True)
        log.info("kvroute epp: ext_proc on %s, metrics on %s", self.grpc_address, self.metrics_url)

    async def _set_ready(self, ok: bool) -> None:
        self.ready = ok
        for service in READY_SERVICES:
            await self.front.set_health(service, SERVING if ok else NOT_SERVING)

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop taking streams (NOT_SERVING first), let open ones finish for up to
        ``grace_s``, then stop the core."""
        with contextlib.suppress(Exception):
            await self._set_ready(False)
        await self.front.stop(grace_s)
        if self._http is not None:
            self._http.should_exit = True
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        self._sock.close()
        await self.picker.stop()

    async def __aenter__(self) -> EppServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop(grace_s=1.0)


class _QuietServer(uvicorn.Server):
    """uvicorn that leaves signal handling to the loop's owner."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield
