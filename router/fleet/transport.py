"""How the router speaks HTTP to its pods: :class:`PodTransport`, a minimal HTTP/1.1
keep-alive transport (also an httpx transport, for scrapes and health checks).

Hand-written instead of httpcore because httpcore's pool cost grew with concurrency (see
:class:`PodTransport`); it stays small, isolated and covered by tests/router/test_proxy.py
and tests/router/test_tls.py.  A pod endpoint is parsed once into a :class:`PodTarget`.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import AsyncIterator, Callable

import httptools
import httpx

from router.fleet.tls import PodTLS

log = logging.getLogger(__name__)

#: response headers not passed back
DROP_RESPONSE = frozenset(
    {"content-length", "connection", "keep-alive", "transfer-encoding", "date", "server"}
)
DROP_RESPONSE_B = frozenset(h.encode() for h in DROP_RESPONSE)

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


#: a streaming body buffered beyond this (the client reads slower than the pod writes)
#: pauses reading from the pod until the relay catches up
PAUSE_ABOVE = 1 << 20


def _expire(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_exception(httpx.ReadTimeout("timed out waiting for the pod"))


class _Deadlines:
    """The read timeouts of every connection waiting for its pod, on one loop timer
    armed for the earliest deadline (a timer per wait cost as much as the rest of the
    read); when it fires, the waits past their deadline fail with ReadTimeout and it is
    armed again for the next one."""

    def __init__(self) -> None:
        self._waiting: set[_Conn] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._at = 0.0

    def add(self, conn: _Conn, loop: asyncio.AbstractEventLoop, deadline: float) -> None:
        self._waiting.add(conn)
        if self._timer is None or deadline < self._at or self._loop is not loop:
            if self._timer is not None:
                self._timer.cancel()
            self._loop = loop
            self._arm(loop, deadline)

    def discard(self, conn: _Conn) -> None:
        self._waiting.discard(conn)

    def _arm(self, loop: asyncio.AbstractEventLoop, at: float) -> None:
        self._at = at
        self._timer = loop.call_at(at, self._fire, loop)

    def _fire(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        now = loop.time()
        nxt: float | None = None
        for conn in list(self._waiting):
            if conn.deadline <= now:
                self._waiting.discard(conn)
                if conn._waiter is not None:
                    _expire(conn._waiter)
            elif nxt is None or conn.deadline < nxt:
                nxt = conn.deadline
        if nxt is not None:
            self._arm(loop, nxt)


class _Conn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection to a pod; responses are parsed as bytes arrive
    (httptools, the parser uvicorn uses) and handed to one waiting reader."""

    def __init__(self, loop: asyncio.AbstractEventLoop, deadlines: _Deadlines) -> None:
        self.loop = loop
        self.deadlines = deadlines
        self.deadline = 0.0  # of the current wait (loop time)
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.reused = False
        self.closed = False
        self.paused = False
        self.error: Exception | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._reset()

    def _reset(self) -> None:
        self.got_bytes = False
        self.head_done = False
        self.complete = False
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        #: the headers a relay passes back (hop-by-hop, Date and Server dropped), names
        #: lowercase (as uvicorn writes them)
        self.relay_headers: list[tuple[bytes, bytes]] = []
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.length: int | None = None
        self.chunked = False
        self.event_stream = False
        self.keep_alive = True

    # -- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.error = httpx.RemoteProtocolError(f"malformed response from the pod: {exc}")
            self.close()
        if self.buffered > PAUSE_ABOVE and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        return False  # close the connection

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.head_done and not self.complete and self.length is None and not self.chunked:
            self.complete = True  # a body delimited by the end of the connection
            self.keep_alive = False
        self._wake()

    # -- httptools callbacks ------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))
        lname = name.lower()
        if lname not in DROP_RESPONSE_B:
            self.relay_headers.append((lname, value))
        if lname == b"content-type":
            self.event_stream = value.startswith(b"text/event-stream")
        elif lname == b"content-length":
            self.length = int(value) if value.strip().isdigit() else None
        elif lname == b"transfer-encoding":
            self.chunked = b"chunked" in value.lower()

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.head_done = True
        if self.status in (204, 304) or 100 <= self.status < 200:
            self.length = 0

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.buffered += len(body)

    def on_message_complete(self) -> None:
        self.complete = True
        self.keep_alive = self.parser.should_keep_alive()

    # -- for the transport ------------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, timeout: float | None) -> None:
        """Until more bytes arrive or the connection ends (ReadTimeout after ``timeout``)."""
        loop = self.loop
        fut = self._waiter = loop.create_future()
        if timeout is None:
            try:
                await fut
            finally:
                self._waiter = None
            return
        self.deadline = loop.time() + timeout
        self.deadlines.add(self, loop, self.deadline)
        try:
            await fut
        finally:
            self._waiter = None
            self.deadlines.discard(self)

    def take(self) -> list[bytes]:
        """The body bytes received so far (and resume reading if it was paused)."""
        chunks, self.chunks, self.buffered = self.chunks, [], 0
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()
        return chunks

    def usable(self) -> bool:
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class _Origin:
    """Idle connections to one (host, port, TLS or not), most recently used first."""

    __slots__ = ("host", "idle", "port", "tls", "tls_problem")

    def __init__(self, host: str, port: int, tls: bool = False) -> None:
        self.host = host
        self.port = port
        self.tls = tls
        self.idle: list[_Conn] = []
        #: the last TLS failure logged for this origin (logged again only when it changes
        #: or after a handshake succeeded: a wrong CA does not log once per request)
        self.tls_problem: str | None = None


class _BodyStream(httpx.AsyncByteStream):
    """A response body as it arrives on its connection (Content-Length, chunked, or
    until close).  Fully read + keep-alive -> the connection goes back to the pool."""

    def __init__(
        self, transport: PodTransport, origin: _Origin, conn: _Conn, read_timeout: float | None
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
        self._deadlines = _Deadlines()

    def _release(self, origin: _Origin, conn: _Conn) -> None:
        if self._closed or len(origin.idle) >= self.max_keepalive:
            conn.close()
            return
        conn.reused = True
        conn._reset()
        origin.idle.append(conn)

    async def _connect(self, origin: _Origin, timeout: float | None) -> _Conn:
        loop = asyncio.get_running_loop()
        if origin.tls:
            return await self._connect_tls(loop, origin, timeout)
        try:
            async with asyncio.timeout(timeout):
                _, conn = await loop.create_connection(
                    lambda: _Conn(loop, self._deadlines), origin.host, origin.port
                )
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {origin.host}:{origin.port}") from None
        except OSError as exc:
            raise httpx.ConnectError(f"{origin.host}:{origin.port}: {exc}") from None
        return conn

    async def _connect_tls(
        self, loop: asyncio.AbstractEventLoop, origin: _Origin, timeout: float | None
    ) -> _Conn:
        where = f"{origin.host}:{origin.port}"
        try:
            async with asyncio.timeout(timeout):
                _, conn = await loop.create_connection(
                    lambda: _Conn(loop, self._deadlines),
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
            conn: _Conn | None = None
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
        self, origin: _Origin, conn: _Conn, head: bytes, body: bytes, read_timeout: float | None
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
