"""How the router speaks HTTP to its pods: :class:`PodTransport`, a minimal HTTP/1.1
keep-alive transport (also an httpx transport, for scrapes and health checks).

Hand-written instead of httpcore because httpcore's pool cost grew with concurrency (see
:class:`PodTransport`); it stays small, isolated and covered by tests/router/test_proxy.py
and tests/router/test_tls.py.  A pod endpoint is parsed once into a :class:`PodTarget`; each
keep-alive socket is a :class:`router.fleet.pod_connection.PodConnection`.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import AsyncIterator, Callable

import httpx

from router.fleet.pod_connection import DROP_RESPONSE_B, Deadlines, PodConnection
from router.fleet.tls import PodTLS

log = logging.getLogger(__name__)

DEFAULT_PORTS = {"http": 80, "https": 443}


class PodTarget:
    """A pod endpoint, parsed once: where to connect (and whether over TLS) and the
    head's first two lines."""

    __slots__ = ("host", "lead", "port", "tls")

    def __init__(self, url: str, path: str, method: bytes = b"POST") -> None:
        parsed = httpx.URL(url.rstrip("/") + path)
        if parsed.scheme not in DEFAULT_PORTS:
            raise httpx.UnsupportedProtocol(
                f"the pod transport speaks http and https only, not {parsed.scheme!r} ({url})"
            )
        self.host: str = parsed.host
        self.port: int = parsed.port or DEFAULT_PORTS[parsed.scheme]
        self.tls = parsed.scheme == "https"
        self.lead = (
            method + b" " + parsed.raw_path + b" HTTP/1.1\r\nhost: " + parsed.netloc + b"\r\n"
        )


class _Origin:
    """Idle connections to one (host, port, TLS or not), most recently used first."""

    __slots__ = ("host", "idle", "port", "tls", "tls_problem")

    def __init__(self, host: str, port: int, tls: bool = False) -> None:
        self.host = host
        self.port = port
        self.tls = tls
        self.idle: list[PodConnection] = []
        #: the last TLS failure logged for this origin (logged again only when it changes
        #: or after a handshake succeeded: a wrong CA does not log once per request)
        self.tls_problem: str | None = None


class _BodyStream(httpx.AsyncByteStream):
    """A response body as it arrives on its connection (Content-Length, chunked, or
    until close).  Fully read + keep-alive -> the connection goes back to the pool."""

    def __init__(
        self,
        transport: PodTransport,
        origin: _Origin,
        conn: PodConnection,
        read_timeout: float | None,
    ) -> None:
        self._t = transport
        self._origin = origin
        self._conn = conn
        self._timeout = read_timeout
        self._closed = False

    def _check(self) -> None:
        conn = self._conn
        if conn.error is not None:
            raise conn.error
        if conn.closed:
            raise httpx.RemoteProtocolError(
                "peer closed connection without sending complete message body"
            )

    async def wait_body(self, until: Callable[[bytes], bool] | None = None) -> None:
        """Until the first body bytes are here or the body ended (nothing is taken:
        iterating yields them); ReadTimeout after the read timeout.  ``until``: until a
        chunk it is true of (each chunk shown to it once, in order), the body's end, or
        the buffer's pause limit."""
        conn = self._conn
        shown = 0
        while not conn.complete:
            chunks = conn.chunks
            if chunks:
                if until is None:
                    return
                while shown < len(chunks):
                    shown += 1
                    if until(chunks[shown - 1]):
                        return
                if conn.paused:  # (nothing more is read until the relay takes it)
                    return
            self._check()
            await conn.wait(self._timeout)

    async def read_all(self) -> bytes:
        """The whole body."""
        conn = self._conn
        taken: list[bytes] = []
        while not conn.complete:
            self._check()
            if conn.paused:  # over PAUSE_ABOVE: take what is buffered, read on
                taken += conn.take()
            await conn.wait(self._timeout)
        chunks = conn.take()
        if taken:
            chunks = taken + chunks
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def limit_silence(self, timeout_s: float) -> None:
        """From now on a wait for the next bytes fails after ``timeout_s`` (when that is
        shorter than the read timeout), the wait under way included: a stream whose pod
        went away ends once the pod goes silent, while one still flowing goes on."""
        prev = self._timeout
        if prev is not None and prev <= timeout_s:
            return
        self._timeout = timeout_s
        conn = self._conn
        if conn._waiter is not None and not conn._waiter.done():
            at = conn.loop.time() + timeout_s
            if prev is None or at < conn.deadline:  # (prev None: this wait has none)
                conn.deadline = at
                conn.deadlines.add(conn, conn.loop, at)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        conn = self._conn
        try:
            while True:
                if conn.chunks:
                    for chunk in conn.take():
                        yield chunk
                elif conn.complete:
                    break
                else:
                    self._check()
                    await conn.wait(self._timeout)
        finally:
            if not conn.complete:
                await self.aclose()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        conn = self._conn
        if conn.complete and conn.keep_alive and not conn.chunks and conn.usable():
            self._t._release(self._origin, conn)
        else:  # unread body or broken: the connection cannot be reused (this also
            conn.close()  # cancels the request on the pod, which sees EOF)


class PodTransport(httpx.AsyncBaseTransport):
    """A minimal HTTP/1.1 keep-alive transport, O(1) per request; also an httpx transport.

    httpcore's pool checks every pooled connection (a ``poll`` syscall each) for every
    request, which made the proxy's cost grow with concurrency (c128: ~30x slower than
    c1 per request).  Here each pod has a LIFO list of idle connections; a request takes
    the most recent usable one or dials a new one (TCP_NODELAY is set by asyncio).
    Connections are asyncio protocols parsing responses with httptools as bytes arrive
    (no stream reader, no per-read timeout context).  A request that fails on a *reused*
    connection before any response byte arrived is retried once on a fresh connection
    (the pod closed the idle connection meanwhile).  ``https`` origins connect with
    ``tls``'s context (the TLS handshake is part of connecting: a failed one is a
    ConnectError); the request body must be bytes.  The proxy calls :meth:`send_raw`;
    httpx requests (scrapes) take their timeouts from the request's ``timeout``
    extension.
    """

    def __init__(self, max_keepalive_per_pod: int = 200, tls: PodTLS | None = None) -> None:
        self.max_keepalive = max_keepalive_per_pod
        self.tls = tls if tls is not None else PodTLS()
        self._origins: dict[tuple[str, int, bool], _Origin] = {}
        self._closed = False
        self._deadlines = Deadlines()

    def _release(self, origin: _Origin, conn: PodConnection) -> None:
        if self._closed or len(origin.idle) >= self.max_keepalive:
            conn.close()
            return
        conn.reused = True
        conn._reset()
        origin.idle.append(conn)

    async def _connect(self, origin: _Origin, timeout: float | None) -> PodConnection:
        loop = asyncio.get_running_loop()
        if origin.tls:
            return await self._connect_tls(loop, origin, timeout)
        try:
            async with asyncio.timeout(timeout):
                _, conn = await loop.create_connection(
                    lambda: PodConnection(loop, self._deadlines), origin.host, origin.port
                )
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {origin.host}:{origin.port}") from None
        except OSError as exc:
            raise httpx.ConnectError(f"{origin.host}:{origin.port}: {exc}") from None
        return conn

    async def _connect_tls(
        self, loop: asyncio.AbstractEventLoop, origin: _Origin, timeout: float | None
    ) -> PodConnection:
        where = f"{origin.host}:{origin.port}"
        try:
            async with asyncio.timeout(timeout):
                _, conn = await loop.create_connection(
                    lambda: PodConnection(loop, self._deadlines),
                    origin.host,
                    origin.port,
                    ssl=self.tls.context(),
                    server_hostname=origin.host,
                )
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {where} (TCP + TLS handshake)") from None
        except ssl.SSLError as exc:  # a bad certificate, no shared protocol, not TLS...
            problem = f"TLS handshake with pod {where} failed: {exc}"
            if origin.tls_problem != problem:
                origin.tls_problem = problem
                log.warning("%s", problem)
            raise httpx.ConnectError(problem) from None
        except OSError as exc:
            raise httpx.ConnectError(f"{where}: {exc}") from None
        origin.tls_problem = None
        return conn

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        scheme = request.url.scheme
        if scheme not in DEFAULT_PORTS:
            raise httpx.UnsupportedProtocol(
                f"the pod transport speaks http and https only, not {scheme!r}"
            )
        timeouts = request.extensions.get("timeout", {})
        up = await self.send_raw(
            request.url.host,
            request.url.port or DEFAULT_PORTS[scheme],
            self._head(request),
            request.content,
            timeouts.get("connect"),
            timeouts.get("read"),
            scheme == "https",
        )
        return httpx.Response(up.status, headers=up.headers, stream=up.stream)

    async def send_raw(
        self,
        host: str,
        port: int,
        head: bytes,
        body: bytes,
        connect_timeout: float | None,
        read_timeout: float | None,
        tls: bool = False,
    ) -> Upstream:
        """Send a request whose head (request line, headers with Host and
        Content-Length, blank line) is already bytes, over TLS when ``tls``; -> the
        response head and its body stream (close or fully read it to give the
        connection back)."""
        key = (host, port, tls)
        origin = self._origins.get(key)
        if origin is None:
            origin = self._origins[key] = _Origin(host, port, tls)
        while True:
            conn: PodConnection | None = None
            while origin.idle:
                candidate = origin.idle.pop()
                if candidate.usable():
                    conn = candidate
                    break
                candidate.close()
            if conn is None:
                conn = await self._connect(origin, connect_timeout)
            try:
                return await self._exchange(origin, conn, head, body, read_timeout)
            except _StaleConnection:
                conn.close()
                continue  # the pod had closed the idle connection: dial a fresh one
            except BaseException:
                conn.close()
                raise

    @staticmethod
    def _head(request: httpx.Request) -> bytes:
        target = request.url.raw_path
        lines = [request.method.encode() + b" " + target + b" HTTP/1.1"]
        lines += [k + b": " + v for k, v in request.headers.raw]
        return b"\r\n".join(lines) + b"\r\n\r\n"

    async def _exchange(
        self,
        origin: _Origin,
        conn: PodConnection,
        head: bytes,
        body: bytes,
        read_timeout: float | None,
    ) -> Upstream:
        assert conn.transport is not None
        conn.transport.write(head + body)
        while not conn.head_done:
            if conn.error is not None:
                raise conn.error
            if conn.closed:
                if conn.reused and not conn.got_bytes:
                    raise _StaleConnection()
                raise httpx.RemoteProtocolError("server disconnected without sending a response")
            await conn.wait(read_timeout)
        stream = _BodyStream(self, origin, conn, read_timeout)
        return Upstream(conn.status, conn.headers, stream, conn.event_stream, conn.relay_headers)

    async def aclose(self) -> None:
        self._closed = True
        for origin in self._origins.values():
            for conn in origin.idle:
                conn.close()
            origin.idle.clear()


class Upstream:
    """A pod's response head (raw headers as sent) and its body stream."""

    __slots__ = ("headers", "is_event_stream", "relay_headers", "status", "stream")

    def __init__(
        self,
        status: int,
        headers: list[tuple[bytes, bytes]],
        stream: _BodyStream,
        is_event_stream: bool,
        relay_headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        self.status = status
        self.headers = headers
        self.stream = stream
        self.is_event_stream = is_event_stream
        #: ``headers`` less the hop-by-hop ones, Date and Server, names lowercase
        self.relay_headers = (
            relay_headers
            if relay_headers is not None
            else [(k.lower(), v) for k, v in headers if k.lower() not in DROP_RESPONSE_B]
        )


class _StaleConnection(Exception):
    """A reused keep-alive connection was closed by the pod before answering."""
