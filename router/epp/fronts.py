"""The gRPC servers `kvroute epp` can run its ext_proc and health services on
(``kvroute epp --grpc-server``):

* ``h2`` (the default): :mod:`router.epp.h2_grpc`, HTTP/2 on the event loop — one
  wake-up per TCP read, the answers of one go in one write;
* ``grpcio``: grpc.aio (gRPC's C core; every message handed between its polling thread
  and the loop).

Both serve the same :class:`ExtProcStream` per stream and the same health services
(``liveness``, ``readiness``, ``envoy.service.ext_proc.v3.ExternalProcessor`` and
``""``); docs/gateway.md has the measurements that chose the default.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from router.epp import h2_grpc
from router.epp import protocol as P
from router.epp.picker import EndpointPicker
from router.epp.stream import ExtProcStream

log = logging.getLogger(__name__)

SERVERS = ("h2", "grpcio")
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
PROCESS_METHOD = f"/{EXT_PROC_SERVICE}/Process"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class Front(Protocol):
    """What :class:`~router.epp.server.EppServer` needs of a gRPC server."""

    port: int

    async def start(self) -> None: ...

    async def set_health(self, service: str, status: int) -> None: ...

    async def stop(self, grace_s: float) -> None: ...


async def pump(
    picker: EndpointPicker,
    read: Callable[[], Awaitable[Any]],
    write: Callable[[P.ProcessingResponse], Awaitable[None] | None],
    flush: Callable[[], None] | None = None,
) -> bool:
    """One ext_proc stream: each message read is handled and its answers written, until
    the proxy ends the stream (``read`` returns None) or an immediate response ends it.
    False when the picker failed (the caller ends the stream with an error: the
    proxy's failure mode then applies).  ``flush`` sends what ``write`` queued: the
    answers leave before the stream's bookkeeping (:meth:`ExtProcStream.after_send`)
    runs, with no other task in between."""
    stream = ExtProcStream(picker)
    try:
        while True:
            req = await read()
            if req is None:
                return True
            try:
                responses = await stream.handle(req)
            except Exception:
                # a bug must not hang the request: closing the stream with an error lets
                # the proxy apply its failure mode (fail open / closed)
                log.exception("ext_proc stream failed")
                picker.epp.streams.labels("error").inc()
                return False
            for resp in responses:
                sent = write(resp)
                if sent is not None:
                    await sent
            if flush is not None and responses:
                flush()
            try:
                await stream.after_send()
            except Exception:
                # the answers are sent: the request goes on, its accounting is lost
                log.exception("ext_proc stream bookkeeping failed")
                picker.epp.streams.labels("bookkeeping_error").inc()
            if stream.finished:
                return True
    finally:
        await stream.close()


# -- h2 ------------------------------------------------------------------------------------


class H2Front:
    """ext_proc and health on :class:`~router.epp.h2_grpc.H2GrpcServer`."""

    def __init__(self, picker: EndpointPicker, host: str, port: int) -> None:
        self.picker = picker
        self.host, self.port = host, port
        self._health: dict[str, int] = {}
        self._changed = asyncio.Event()
        HReq = health_pb2.HealthCheckRequest
        self._server = h2_grpc.H2GrpcServer(
            {
                PROCESS_METHOD: h2_grpc.Method(self._process, P.ProcessingRequest),
                "/grpc.health.v1.Health/Check": h2_grpc.Method(self._check, HReq),
                "/grpc.health.v1.Health/Watch": h2_grpc.Method(self._watch, HReq),
            }
        )

    async def start(self) -> None:
        self.port = await self._server.start(self.host, self.port)

    async def set_health(self, service: str, status: int) -> None:
        self._health[service] = status
        self._changed.set()
        self._changed = asyncio.Event()

    async def stop(self, grace_s: float) -> None:
        await self._server.stop(grace_s)

    async def _process(self, call: h2_grpc.Call) -> None:
        if not await pump(self.picker, call.read, call.write, call.flush):
            raise h2_grpc.CallError(h2_grpc.INTERNAL, "endpoint picker error")

    async def _check(self, call: h2_grpc.Call) -> None:
        req = await call.read()
        status = self._health.get(req.service if req is not None else "")
        if status is None:
            raise h2_grpc.CallError(h2_grpc.NOT_FOUND, "unknown service")
        call.write(health_pb2.HealthCheckResponse(status=status))

    async def _watch(self, call: h2_grpc.Call) -> None:
        """The service's status now, then each change, until the client goes."""
        req = await call.read()
        service = req.service if req is not None else ""
        last: int | None = None
        while not call.reset and not self._server.closing:
            status = self._health.get(service, _SERVICE_UNKNOWN)
            if status != last:
                call.write(health_pb2.HealthCheckResponse(status=status))
                last = status
            changed = asyncio.ensure_future(self._changed.wait())
            gone = asyncio.ensure_future(call.reset_event.wait())
            await asyncio.wait((changed, gone), return_when=asyncio.FIRST_COMPLETED)
            changed.cancel()
            gone.cancel()


# -- grpcio --------------------------------------------------------------------------------


class _ExternalProcessor(ep_grpc.ExternalProcessorServicer):
    """Envoy's ext_proc service on grpc.aio."""

    def __init__(self, picker: EndpointPicker) -> None:
        self.picker = picker

    async def Process(  # the gRPC method's name
        self, request_iterator: Any, context: Any
    ) -> None:
        """Messages read and answered with ``context.read`` / ``write`` (grpc.aio's
        iterator and async-generator forms cost ~40% more per stream)."""
        eof = grpc.aio.EOF

        async def read() -> Any:
            req = await context.read()
            return None if req is eof else req

        if not await pump(self.picker, read, context.write):
            await context.abort(grpc.StatusCode.INTERNAL, "endpoint picker error")


class GrpcioFront:
    """ext_proc and health on grpc.aio."""

    def __init__(self, picker: EndpointPicker, host: str, port: int) -> None:
        self.server = grpc.aio.server(
            options=[
                # Envoy's ext_proc client opens one HTTP/2 stream per request
                ("grpc.max_concurrent_streams", h2_grpc.MAX_STREAMS),
                ("grpc.max_receive_message_length", h2_grpc.MAX_MESSAGE),
                ("grpc.max_send_message_length", h2_grpc.MAX_MESSAGE),
                ("grpc.so_reuseport", 0),
            ]
        )
        ep_grpc.add_ExternalProcessorServicer_to_server(_ExternalProcessor(picker), self.server)
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        address = f"[{host}]" if ":" in host else host
        self.port = self.server.add_insecure_port(f"{address}:{port}")
        if self.port == 0:
            raise OSError(f"cannot listen for gRPC on {host}:{port}")

    async def start(self) -> None:
        await self.server.start()

    async def set_health(self, service: str, status: int) -> None:
        await self.health.set(service, status)

    async def stop(self, grace_s: float) -> None:
        with contextlib.suppress(Exception):
            await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)


def make_front(kind: str, picker: EndpointPicker, host: str, port: int) -> Front:
    if kind == "h2":
        return H2Front(picker, host, port)
    if kind == "grpcio":
        return GrpcioFront(picker, host, port)
    raise ValueError(f"unknown gRPC server {kind!r} (one of {', '.join(SERVERS)})")
