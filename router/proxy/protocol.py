"""`kvroute serve`'s HTTP/1.1 protocol: uvicorn's httptools protocol, writing each
response in one ``send()``, with a keep-alive timer not re-made per request, and with the
limits a gateway facing clients needs (uvicorn's httptools protocol has none of them; its
h11 protocol has only ``h11_max_incomplete_event_size``, answered with a plain 400):

* **header limits** — a request head larger than ``max_header_bytes`` (request line and
  header lines) or with more than ``max_headers`` header lines is answered 431 and the
  connection closed, before the app sees it.  A head still incomplete past the limit is
  refused as soon as the bytes received while reading it pass the limit, so an endless
  header costs at most one read beyond it;
* **idle connections** — a connection with no request in progress (just opened, or
  between keep-alive requests) is closed after ``keepalive_timeout_s``, silently;
* **slow heads and bodies** — a request whose head has not fully arrived
  ``header_timeout_s`` after its first bytes, or whose body has not fully arrived
  ``body_timeout_s`` after its head (a client that stops or trickles), is answered 408
  and its connection closed (only closed if the app already answered).

The limits come from the app's ``client_limits`` attribute (a :class:`ClientLimits`; the
router app sets it from ``proxy.*``; middleware wrappers are looked through), else the
defaults here with uvicorn's ``timeout_keep_alive``.  Rejections are counted through
``ClientLimits.on_reject(reason)`` and logged at most once per reason per 10 s
(``ClientLimits.log``).

Costs nothing per request on the common path: a head and body that arrive in one read
arm no timer and count no header; the exact header count runs only when the bytes read
while in the head pass ``max_header_bytes``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httptools
import msgspec
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from router.errors import error_body
from router.logs import RateLimitedLog

log = logging.getLogger(__name__)
_encode = msgspec.json.encode


@dataclass(frozen=True)
class ClientLimits:
    """What one client connection may do (see the module docstring)."""

    max_header_bytes: int = 64 * 1024
    max_headers: int = 100
    keepalive_timeout_s: float | None = None  # None: uvicorn's timeout_keep_alive
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    #: told the reason of every refused request (``headers_too_large``, ...)
    on_reject: Callable[[str], None] | None = None
    #: where refusals are logged (one line per reason per interval)
    log: RateLimitedLog = field(default_factory=lambda: RateLimitedLog(log), compare=False)


DEFAULT_LIMITS = ClientLimits()

_IDLE, _HEAD, _BODY = 0, 1, 2

_STATUS_LINE = {
    408: b"HTTP/1.1 408 Request Timeout\r\n",
    431: b"HTTP/1.1 431 Request Header Fields Too Large\r\n",
}


class _Refused(Exception):
    """Raised in a parser callback to stop parsing a request that is refused."""


def limits_of(app: Any) -> ClientLimits:
    """The ``client_limits`` of ``app`` or of an app it wraps (uvicorn's middlewares keep
    the wrapped app as ``.app``), else the defaults."""
    for _ in range(8):
        limits = getattr(app, "client_limits", None)
        if isinstance(limits, ClientLimits):
            return limits
        app = getattr(app, "app", None)
        if app is None:
            break
    return DEFAULT_LIMITS


class OneWriteTransport:
    """A transport wrapper that sends everything written within one event-loop step as
    one ``send()``, at the end of the step (``call_soon``).  uvicorn writes a response's
    head and body separately, and an uncorked socket sends each at once: two syscalls,
    two TCP segments and two wake-ups of the client per response.  Everything else is
    the wrapped transport's."""

    __slots__ = ("_buf", "_loop", "_scheduled", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._buf: list[bytes] = []
        self._scheduled = False

    def write(self, data: bytes) -> None:
        if not data:
            return
        self._buf.append(data)
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush)

    def write_now(self, data: bytes) -> None:
        """Write ``data`` at once, after anything written before it in this step (one
        ``send()``; nothing left for the end of the step)."""
        if self._buf:
            self._buf.append(data)
            self.flush()
        elif not self._transport.is_closing():
            self._transport.write(data)

    def flush(self) -> None:
        self._scheduled = False
        buf = self._buf
        if not buf:
            return
        data = buf[0] if len(buf) == 1 else b"".join(buf)
        self._buf = []
        if not self._transport.is_closing():
            self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(len(b) for b in self._buf)

    # asked on every request: spelled out (``__getattr__`` runs only after a failed
    # lookup, which costs more than the call)
    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class OneWriteHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, writing through :class:`OneWriteTransport` (one
    ``send()`` per response instead of head + body), with a keep-alive timer that is
    not re-made per request, and the client limits of the module docstring.

    uvicorn arms a ``timeout_keep_alive`` timer after every response and cancels it when
    the next request's bytes arrive: two timer operations per request on a busy
    connection.  Here the response only notes when the connection went idle; the timer,
    armed once, checks when it fires whether the connection has been idle for the
    whole timeout (then closes it) or re-arms for the end of the current idle period
    (a busy connection re-arms at its next response).  The read deadlines (head, body)
    work the same way: one timer per connection, armed only when a read ends with a
    request incomplete."""

    _idle_since: float | None = None
    _limits: ClientLimits = DEFAULT_LIMITS
    _phase = _IDLE
    #: bytes received while reading the current head (whole reads: an upper bound)
    _head_raw = 0
    #: when the current phase (head or body) must be over (loop time; 0: not yet set)
    _deadline = 0.0
    _read_timer: asyncio.TimerHandle | None = None
    _refusal: tuple[int, str, str] | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(OneWriteTransport(transport, self.loop))  # type: ignore[arg-type]
        limits = self._limits = limits_of(self.app)
        if limits.keepalive_timeout_s is not None:
            self.timeout_keep_alive = limits.keepalive_timeout_s  # type: ignore[assignment]
        self._mark_idle()  # a connection that never sends a byte is closed too

    # -- reading ---------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        # uvicorn's, plus the head size bound, the 431 / 408 answers and a rate-limited
        # log line for malformed requests
        self._idle_since = None  # _unset_keepalive_if_required, inline (once per read)
        if self._phase != _BODY:
            self._head_raw += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError:
            if self._refusal is not None:
                self._refuse(*self._refusal)
                return
            msg = "Invalid HTTP request received."
            self._limits.log.warning("invalid_http", "%s", msg)
            self._count("invalid_http")
            self.send_400_response(msg)
            return
        phase = self._phase
        if phase == _IDLE:
            return
        if phase == _HEAD and self._head_raw > self._limits.max_header_bytes:
            limit = self._limits.max_header_bytes
            self._refuse(
                431,
                "headers_too_large",
                f"request head larger than {limit} bytes (proxy.max_header_bytes)",
            )
            return
        if self._deadline == 0.0 and not self.transport.is_closing():
            limits = self._limits
            timeout = limits.header_timeout_s if phase == _HEAD else limits.body_timeout_s
            self._deadline = self.loop.time() + timeout
            if self._read_timer is None:
                self._read_timer = self.loop.call_at(self._deadline, self._read_timeout)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._phase = _HEAD
        self._deadline = 0.0

    def on_headers_complete(self) -> None:
        limits = self._limits
        if len(self.headers) > limits.max_headers:
            self._refusal = (
                431,
                "too_many_headers",
                f"more than {limits.max_headers} request headers (proxy.max_headers)",
            )
            raise _Refused()
        # the reads of this head were larger than the limit: count it exactly (also for
        # a pipelined head that began inside a body read, where nothing was counted)
        if self._head_raw > limits.max_header_bytes or self._head_raw == 0:
            size = len(self.url) + sum(len(k) + len(v) + 4 for k, v in self.headers)
            if size > limits.max_header_bytes:
                self._refusal = (
                    431,
                    "headers_too_large",
                    f"request head larger than {limits.max_header_bytes} bytes "
                    "(proxy.max_header_bytes)",
                )
                raise _Refused()
        self._phase = _BODY
        self._deadline = 0.0
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._phase = _IDLE
        self._head_raw = 0

    def _read_timeout(self) -> None:
        self._read_timer = None
        if self._phase == _IDLE or self.transport.is_closing():
            return
        now = self.loop.time()
        if now < self._deadline:
            self._read_timer = self.loop.call_at(self._deadline, self._read_timeout)
            return
        limits = self._limits
        if self._phase == _HEAD:
            self._refuse(
                408,
                "header_timeout",
                f"request head not received within {limits.header_timeout_s:g} s "
                "(proxy.client_header_timeout_s)",
            )
        else:
            self._refuse(
                408,
                "body_timeout",
                f"request body not received within {limits.body_timeout_s:g} s of its head "
                "(proxy.client_body_timeout_s)",
            )

    # -- refusing --------------------------------------------------------------------

    def _count(self, reason: str) -> None:
        if self._limits.on_reject is not None:
            try:
                self._limits.on_reject(reason)
            except Exception:  # counting must never break the connection handling
                log.debug("counting a refused request failed", exc_info=True)

    def _refuse(self, status: int, reason: str, message: str) -> None:
        """Answer ``status`` with an OpenAI error naming the limit, then close the
        connection.  Only closed when a response is under way on it: the app already
        answered this request (a body refused, e.g. 413, and then trickled), or a
        pipelined head arrives while the previous response is still being written."""
        in_body = self._phase == _BODY
        self._refusal = None
        self._phase = _IDLE
        self._count(reason)
        self._limits.log.warning(reason, "client request refused (%d): %s", status, message)
        cycle = self.cycle
        if cycle is None:
            busy = False
        elif in_body:  # the cycle is this request's
            busy = cycle.response_started
        else:  # the cycle is the previous request's
            busy = not cycle.response_complete
        if not busy and not self.transport.is_closing():
            body = _encode(error_body(message, "invalid_request_error", None, reason))
            self.transport.write(
                _STATUS_LINE[status] + b"content-type: application/json\r\ncontent-length: %d\r\n"
                b"connection: close\r\n\r\n" % len(body) + body
            )
        self.transport.close()

    # -- keep-alive ------------------------------------------------------------------

    def _mark_idle(self) -> None:
        self._idle_since = self.loop.time()
        if self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

    def _unset_keepalive_if_required(self) -> None:
        self._idle_since = None  # busy: the timer, if armed, finds the connection busy

    def on_response_complete(self) -> None:
        if self.pipeline or self.transport.is_closing():
            super().on_response_complete()  # the next pipelined request, or nothing
            return
        # uvicorn's otherwise, but the keep-alive timer is armed only when none is
        self.server_state.total_requests += 1
        self.flow.resume_reading()
        self._idle_since = self.loop.time()  # _mark_idle, inline (once per response)
        if self.timeout_keep_alive_task is None:
            self.timeout_keep_alive_task = self.loop.call_later(
                self.timeout_keep_alive, self.timeout_keep_alive_handler
            )

    def timeout_keep_alive_handler(self) -> None:
        self.timeout_keep_alive_task = None
        idle = self._idle_since
        if idle is None or self.transport.is_closing():
            return  # busy (its response re-arms) or gone
        due = idle + self.timeout_keep_alive
        if self.loop.time() >= due:
            self.transport.close()
        else:
            self.timeout_keep_alive_task = self.loop.call_at(due, self.timeout_keep_alive_handler)

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self.timeout_keep_alive_task is not None:
            self.timeout_keep_alive_task.cancel()
            self.timeout_keep_alive_task = None
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
