"""A small gRPC server on the event loop (HTTP/2 by ``h2``), for the few methods the EPP
serves: Envoy's ext_proc ``Process`` stream and gRPC health ``Check`` / ``Watch``.

Why (docs/gateway.md, "What the picker adds"): grpc.aio hands every message read or
written between gRPC's C-core polling thread and the event loop, and each of a small
request's ~12 ext_proc messages then waits for a thread to wake; here the loop reads
the socket itself, so a TCP read carrying Envoy's three request messages (headers, body,
end of body) is one wake-up, and the answers the picker gives in one go leave in one
write (:meth:`_Connection.flush` runs once the stream's task waits for the next
message).

What it implements of gRPC over HTTP/2: cleartext HTTP/2 with prior knowledge (what
Envoy's ``envoy_grpc`` client and grpcio clients speak), length-prefixed uncompressed
messages (a compressed one fails the call: Envoy does not compress ext_proc), status in
trailers, ``UNIMPLEMENTED`` for unknown methods, flow control both ways (inbound windows
of :data:`WINDOW` bytes, acknowledged as the handler consumes messages; outbound data
waits for the peer's window), a client's reset seen by the handler as the end of its
input, and a graceful stop (GOAWAY, then ``grace_s`` for open streams).  No TLS (the EPP's
gRPC port is cleartext, as with grpcio's insecure port), no ``grpc-timeout`` (the proxy
has its own message timeout).

The server and its connections are here; one call's side (:class:`Call`: its messages
in, their acknowledgements, its answers and status out) is in :mod:`router.epp.h2_call`,
with :class:`Method`, :class:`CallError` and the status codes, all re-exported here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import Any, cast
from urllib.parse import quote

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
import hyperframe.frame

from router.epp.h2_call import (
    INTERNAL,
    MAX_MESSAGE,
    NOT_FOUND,
    OK,
    RESOURCE_EXHAUSTED,
    UNIMPLEMENTED,
    UNKNOWN,
    Call,
    CallError,
    Handler,
    Method,
)

__all__ = [
    "INTERNAL",
    "MAX_FRAME",
    "MAX_MESSAGE",
    "MAX_STREAMS",
    "NOT_FOUND",
    "OK",
    "RESOURCE_EXHAUSTED",
    "UNIMPLEMENTED",
    "UNKNOWN",
    "WINDOW",
    "Call",
    "CallError",
    "H2GrpcServer",
    "Handler",
    "Method",
]

log = logging.getLogger(__name__)

#: inbound flow-control window of each stream and of each connection
WINDOW = 8 * 1024 * 1024
#: largest HTTP/2 frame we accept (fewer, larger DATA frames for big bodies)
MAX_FRAME = 1024 * 1024
MAX_STREAMS = 10_000


class _Connection(asyncio.Protocol):
    """One HTTP/2 connection of the server."""

    def __init__(self, server: H2GrpcServer) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        config = h2.config.H2Configuration(
            client_side=False,
            header_encoding="utf-8",
            validate_inbound_headers=False,
            validate_outbound_headers=False,
            normalize_inbound_headers=False,
            normalize_outbound_headers=False,
        )
        self.h2 = h2.connection.H2Connection(config=config)
        self.transport: asyncio.Transport | None = None
        self.calls: dict[int, Call] = {}
        self.tasks: set[asyncio.Task[None]] = set()
        self._flush_scheduled = False
        self._dirty: set[Call] = set()  # calls with something to send
        self._blocked: set[Call] = set()  # calls waiting for the peer's window

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's is not a subclass)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        h2c = self.h2
        h2c.local_settings = h2.settings.Settings(
            client=False,
            initial_values={
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: MAX_STREAMS,
                h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: WINDOW,
                h2.settings.SettingCodes.MAX_FRAME_SIZE: MAX_FRAME,
            },
        )
        # (values given at creation are in force at once: the first SETTINGS frame
        # carries them, and the peer may only exceed the defaults once it has them)
        h2c.max_inbound_frame_size = h2c.incoming_buffer.max_frame_size = MAX_FRAME
        h2c.initiate_connection()
        h2c.increment_flow_control_window(WINDOW - 65_535)
        self.server.connections.add(self)
        self.flush()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        for call in list(self.calls.values()):
            call.on_reset()
        self.calls.clear()
        self._dirty.clear()
        self._blocked.clear()
        self.transport = None

    def data_received(self, data: bytes) -> None:
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            log.warning("gRPC connection closed: HTTP/2 protocol error: %s", exc)
            self.flush()
            if self.transport is not None:
                self.transport.close()
            return
        for event in events:
            self._event(event)
        self.flush()

    def _event(self, event: Any) -> None:
        if isinstance(event, h2.events.DataReceived):
            call = self.calls.get(event.stream_id)
            if call is not None:
                call.feed(event.data, event.flow_controlled_length)
            else:
                self.ack(event.stream_id, event.flow_controlled_length)
        elif isinstance(event, h2.events.RequestReceived):
            self._start(event.stream_id, event.headers)
        elif isinstance(event, h2.events.StreamEnded | h2.events.TrailersReceived):
            call = self.calls.get(event.stream_id)
            if call is not None:
                call.end_input()
        elif isinstance(event, h2.events.StreamReset):
            call = self.calls.pop(event.stream_id, None)
            if call is not None:
                call.on_reset()
                self._blocked.discard(call)
        elif isinstance(event, h2.events.WindowUpdated | h2.events.RemoteSettingsChanged):
            for call in self._blocked:
                self.want_flush(call)

    def _start(self, stream_id: int, headers: Any) -> None:
        path = ""
        for name, value in headers:
            if name == ":path":
                path = value
                break
        method = self.server.methods.get(path)
        if method is None or self.server.closing:
            code = UNIMPLEMENTED if method is None else 14  # UNAVAILABLE
            message = f"unknown method {path}" if method is None else "shutting down"
            trailers = [
                (":status", "200"),
                ("content-type", "application/grpc"),
                ("grpc-status", str(code)),
                ("grpc-message", quote(message, safe=" ")),
            ]
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self.h2.send_headers(stream_id, trailers, end_stream=True)
                self.h2.reset_stream(stream_id, h2.errors.ErrorCodes.NO_ERROR)
            return
        call = Call(self, stream_id, method)
        self.calls[stream_id] = call
        task = self.loop.create_task(self._run(call, method.handler))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _run(self, call: Call, handler: Handler) -> None:
        code, message = OK, ""
        try:
            await handler(call)
            if call.error is not None:
                code, message = call.error.code, call.error.message
        except CallError as err:
            code, message = err.code, err.message
        except asyncio.CancelledError:
            code, message = 1, "cancelled"  # CANCELLED
            raise
        except Exception:
            log.exception("gRPC handler failed")
            code, message = UNKNOWN, "handler error"
        finally:
            call.release()
            call.finish(code, message)

    def ack(self, stream_id: int, size: int) -> None:
        if size and self.transport is not None:
            with contextlib.suppress(h2.exceptions.ProtocolError):
                self.h2.acknowledge_received_data(size, stream_id)
            self.want_flush()

    def want_flush(self, call: Call | None = None) -> None:
        if call is not None:
            self._dirty.add(call)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        """Everything the calls have to send, in one write."""
        self._flush_scheduled = False
        if self.transport is None:
            return
        h2c = self.h2
        dirty, self._dirty = self._dirty, set()
        for call in dirty:
            try:
                sent = call.send_pending(h2c)
            except (h2.exceptions.StreamClosedError, h2.exceptions.ProtocolError):
                call.on_reset()
                sent = True
            if sent:
                self._blocked.discard(call)
                if call.closed or call.reset:
                    self.calls.pop(call.stream_id, None)
            else:
                self._blocked.add(call)
        data = h2c.data_to_send()
        if data:
            self.transport.write(data)

    def goaway(self) -> None:
        """Tell the client to open no more streams; the open ones go on (h2's own
        ``close_connection`` would end the connection's state machine)."""
        if self.transport is not None:
            self.flush()
            frame = hyperframe.frame.GoAwayFrame(
                stream_id=0, last_stream_id=self.h2.highest_inbound_stream_id, error_code=0
            )
            self.transport.write(frame.serialize())


class H2GrpcServer:
    """Serves ``methods`` (``/package.Service/Method`` -> :class:`Method`) on one TCP
    port of the running loop."""

    def __init__(self, methods: dict[str, Method]) -> None:
        self.methods = methods
        self.connections: set[_Connection] = set()
        self.closing = False
        self._server: asyncio.AbstractServer | None = None

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: a free port); returns the port."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _Connection(self), host, port, reuse_address=True, backlog=1024
        )
        return int(self._server.sockets[0].getsockname()[1])

    async def stop(self, grace_s: float) -> None:
        """Stop listening, tell clients (GOAWAY), let open calls finish for up to
        ``grace_s``, then cancel them and close the connections."""
        self.closing = True
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.goaway()
        tasks = [t for conn in self.connections for t in conn.tasks]
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=max(grace_s, 0.0))
            for task in late:
                task.cancel()
            if late:
                await asyncio.wait(late, timeout=1.0)
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.flush()
                conn.transport.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
