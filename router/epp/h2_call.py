"""One call of :class:`router.epp.h2_grpc.H2GrpcServer` (an HTTP/2 stream) and what its
handler deals with: :class:`Method` (a served method), :class:`CallError` (a status to end
the call with), the gRPC status codes.

:class:`Call` cuts the client's length-prefixed messages out of the stream's DATA as it
arrives (a compressed one, one over :data:`MAX_MESSAGE` bytes or one that does not parse
fails the call), acknowledges them to the connection as the handler reads them (and what
it leaves unread when it returns), and queues the answers and the status until the
connection's flush puts them into HTTP/2 as far as the peer's window allows.  The
connection and the server are in :mod:`router.epp.h2_grpc`, which re-exports the names
defined here.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import h2.connection
import h2.errors
import h2.exceptions

if TYPE_CHECKING:
    from router.epp.h2_grpc import _Connection

#: largest gRPC message accepted (as grpcio's ``max_receive_message_length`` in fronts.py)
MAX_MESSAGE = 64 * 1024 * 1024
#: gRPC status codes used by the server and its handlers
OK, UNKNOWN, NOT_FOUND, RESOURCE_EXHAUSTED, UNIMPLEMENTED, INTERNAL = 0, 2, 5, 8, 12, 13

Handler = Callable[["Call"], Awaitable[None]]


class Method:
    """One served method: its handler and the type of the messages it reads."""

    def __init__(self, handler: Handler, request_type: Any) -> None:
        self.handler = handler
        self.request_type = request_type


class CallError(Exception):
    """Raised by a handler to end its call with ``code`` and ``message``."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Call:
    """One gRPC call (an HTTP/2 stream): :meth:`read` the client's messages, :meth:`write`
    answers (sent at the next flush); the status goes when the handler returns."""

    def __init__(self, conn: _Connection, stream_id: int, method: Method) -> None:
        self._conn = conn
        self.stream_id = stream_id
        self._parse = method.request_type.FromString
        self._buf = bytearray()
        self._messages: deque[Any] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._unacked = 0
        #: the client ended its side (or reset the stream, or the connection went)
        self.input_done = False
        #: the handler returned: what still arrives is acknowledged at once (dropped)
        self._released = False
        #: the stream was reset or the connection lost: writes go nowhere
        self.reset = False
        self.reset_event = asyncio.Event()
        self._headers_sent = False
        self._pending: deque[bytes] = deque()  # framed messages waiting for the window
        self._trailers: list[tuple[str, str]] | None = None
        #: the status went: the call is over on our side
        self.closed = False
        self.error: CallError | None = None

    # -- the handler's side ---------------------------------------------------------------

    async def read(self) -> Any:
        """The next message (None: the client ended its side)."""
        while not self._messages:
            if self.input_done or self.error is not None:
                return None
            self._waiter = self._conn.loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self._unacked:
            self._conn.ack(self.stream_id, self._unacked)
            self._unacked = 0
        return self._messages.popleft()

    def write(self, message: Any) -> None:
        """Queue ``message`` (a protobuf) for the client (sent at the next flush)."""
        if self.reset:
            return
        payload = message.SerializeToString()
        self._pending.append(b"\0" + len(payload).to_bytes(4, "big") + payload)
        self._conn.want_flush(self)

    def flush(self) -> None:
        """Send what is queued now, not at the loop's next turn."""
        self._conn.flush()

    # -- the connection's side ------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def feed(self, data: bytes, flow_controlled: int) -> None:
        self._unacked += flow_controlled
        if self._released:
            self.release()
            return
        if self.error is not None:  # the call is failing: the rest is dropped
            return
        buf = self._buf
        buf += data
        got = False
        while len(buf) >= 5:
            size = int.from_bytes(buf[1:5], "big")
            if buf[0] != 0:
                self.error = CallError(UNIMPLEMENTED, "compressed messages are not supported")
                break
            if size > MAX_MESSAGE:
                self.error = CallError(RESOURCE_EXHAUSTED, f"message of {size} bytes")
                break
            if len(buf) < 5 + size:
                break
            try:
                self._messages.append(self._parse(bytes(buf[5 : 5 + size])))
            except Exception as exc:  # a malformed message fails the call, not the loop
                self.error = CallError(INTERNAL, f"cannot parse the message: {exc}")
                break
            del buf[: 5 + size]
            got = True
        if got or self.error is not None:
            self._wake()

    def release(self) -> None:
        """The handler is done: acknowledge what it left unread (else the connection's
        window would shrink by it for good)."""
        self._released = True
        self._messages.clear()
        if self._unacked:
            self._conn.ack(self.stream_id, self._unacked)
            self._unacked = 0

    def end_input(self) -> None:
        self.input_done = True
        self._wake()

    def on_reset(self) -> None:
        self.reset = True
        self._pending.clear()
        self.reset_event.set()
        self.end_input()

    def finish(self, code: int, message: str = "") -> None:
        """The handler returned: the status follows what was written."""
        if self.reset:
            return
        trailers = [("grpc-status", str(code))]
        if message:
            trailers.append(("grpc-message", quote(message, safe=" ")))
        self._trailers = trailers
        self._conn.want_flush(self)

    def send_pending(self, h2c: h2.connection.H2Connection) -> bool:
        """Put what the peer's window allows into ``h2c``; True when nothing is left
        to send (then, with the status sent, the call is over)."""
        if self.reset:
            return True
        sid = self.stream_id
        pending = self._pending
        if not self._headers_sent:
            if not pending and self._trailers is None:
                return True
            headers = [(":status", "200"), ("content-type", "application/grpc")]
            if not pending and self._trailers is not None:  # trailers only
                h2c.send_headers(sid, headers + self._trailers, end_stream=True)
                self._headers_sent, self._trailers = True, None
                self._closed(h2c)
                return True
            h2c.send_headers(sid, headers)
            self._headers_sent = True
        while pending:
            window = min(h2c.local_flow_control_window(sid), h2c.max_outbound_frame_size)
            if window <= 0:
                return False
            data = pending[0]
            if len(data) <= window:
                h2c.send_data(sid, data)
                pending.popleft()
            else:
                h2c.send_data(sid, data[:window])
                pending[0] = data[window:]
        if self._trailers is not None:
            h2c.send_headers(sid, self._trailers, end_stream=True)
            self._trailers = None
            self._closed(h2c)
        return True

    def _closed(self, h2c: h2.connection.H2Connection) -> None:
        """Our side is over; a client still sending is told to stop (RST_STREAM
        NO_ERROR after the status, as HTTP/2 has a server that answered early do)."""
        self.closed = True
        if not self.input_done:
            with contextlib.suppress(h2.exceptions.ProtocolError):
                h2c.reset_stream(self.stream_id, h2.errors.ErrorCodes.NO_ERROR)
