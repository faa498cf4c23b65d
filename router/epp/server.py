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
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import uvicorn
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from router.epp import protocol as P
from router.epp.picker import EndpointPicker
from router.epp.stream import ExtProcStream
from router.metrics import CONTENT_TYPE

log = logging.getLogger(__name__)

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
READY_SERVICES = ("", "readiness", EXT_PROC_SERVICE)
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class ExternalProcessor(ep_grpc.ExternalProcessorServicer):
    """Envoy's ext_proc service: one :class:`ExtProcStream` per stream."""

    def __init__(self, picker: EndpointPicker) -> None:
        self.picker = picker

    async def Process(  # the gRPC method's name
        self, request_iterator: AsyncIterator[P.ProcessingRequest], context: Any
    ) -> None:
        """One stream: messages read and answered with ``context.read`` / ``write``
        (grpc.aio's iterator and async-generator forms cost ~40% more per stream)."""
        stream = ExtProcStream(self.picker)
        read, write = context.read, context.write
        eof = grpc.aio.EOF
        try:
            while True:
                req = await read()
                if req is eof:
                    return
                try:
                    responses = await stream.handle(req)
                except Exception:
                    # a bug must not hang the request: closing the stream with an error
                    # lets the proxy apply its failure mode (fail open / closed)
                    log.exception("ext_proc stream failed")
                    self.picker.epp.streams.labels("error").inc()
                    await context.abort(grpc.StatusCode.INTERNAL, "endpoint picker error")
                    return
                for resp in responses:
                    await write(resp)
                if stream.finished:
                    return
        finally:
            await stream.close()


class EppServer:
    """The gRPC server (ext_proc + health) and the HTTP server (metrics) of one picker."""

    def __init__(
        self,
        picker: EndpointPicker,
        *,
        grpc_host: str = "127.0.0.1",
        grpc_port: int = 9002,
        metrics_host: str = "127.0.0.1",
        metrics_port: int = 9090,
    ) -> None:
        self.picker = picker
        self.grpc = grpc.aio.server(
            options=[
                # Envoy's ext_proc client opens one HTTP/2 stream per request
                ("grpc.max_concurrent_streams", 10_000),
                ("grpc.max_receive_message_length", 64 * 1024 * 1024),
                ("grpc.max_send_message_length", 64 * 1024 * 1024),
                ("grpc.so_reuseport", 0),
            ]
        )
        ep_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(picker), self.grpc)
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        address = f"[{grpc_host}]" if ":" in grpc_host else grpc_host
        self.grpc_port = self.grpc.add_insecure_port(f"{address}:{grpc_port}")
        if self.grpc_port == 0:
            raise OSError(f"cannot listen for gRPC on {grpc_host}:{grpc_port}")
        self.grpc_address = f"{grpc_host}:{self.grpc_port}"
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((metrics_host, metrics_port))
        self.metrics_url = "http://{}:{}".format(*self._sock.getsockname()[:2])
        self._http: Any = None
        self._tasks: list[asyncio.Task[Any]] = []
        self.ready = False

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
        await self.health.set("liveness", _SERVING)
        await self._set_ready(False)
        await self.picker.start()
        await self.grpc.start()
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
            await self.health.set(service, _SERVING if ok else _NOT_SERVING)

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop taking streams (NOT_SERVING first), let open ones finish for up to
        ``grace_s``, then stop the core."""
        with contextlib.suppress(Exception):
            await self._set_ready(False)
            await self.health.enter_graceful_shutdown()
        await self.grpc.stop(grace_s)
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
