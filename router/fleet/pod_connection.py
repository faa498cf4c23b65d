"""One keep-alive HTTP/1.1 connection to a pod (:class:`PodConnection`), parsed by
httptools as bytes arrive, and the one timer that expires every connection's read
deadline (:class:`Deadlines`).  :class:`router.fleet.transport.PodTransport` pools them."""

from __future__ import annotations

import asyncio

import httptools
import httpx

#: response headers not passed back
DROP_RESPONSE = frozenset(
    {"content-length", "connection", "keep-alive", "transfer-encoding", "date", "server"}
)
DROP_RESPONSE_B = frozenset(h.encode() for h in DROP_RESPONSE)


#: a streaming body buffered beyond this (the client reads slower than the pod writes)
#: pauses reading from the pod until the relay catches up
PAUSE_ABOVE = 1 << 20


def _expire(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_exception(httpx.ReadTimeout("timed out waiting for the pod"))


class Deadlines:
    """The read timeouts of every connection waiting for its pod, on one loop timer
    armed for the earliest deadline (a timer per wait cost as much as the rest of the
    read); when it fires, the waits past their deadline fail with ReadTimeout and it is
    armed again for the next one."""

    def __init__(self) -> None:
        self._waiting: set[PodConnection] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._at = 0.0

    def add(self, conn: PodConnection, loop: asyncio.AbstractEventLoop, deadline: float) -> None:
        self._waiting.add(conn)
        if self._timer is None or deadline < self._at or self._loop is not loop:
            if self._timer is not None:
                self._timer.cancel()
            self._loop = loop
            self._arm(loop, deadline)

    def discard(self, conn: PodConnection) -> None:
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


class PodConnection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection to a pod; responses are parsed as bytes arrive
    (httptools, the parser uvicorn uses) and handed to one waiting reader."""

    def __init__(self, loop: asyncio.AbstractEventLoop, deadlines: Deadlines) -> None:
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
