"""A complete response written in one go on `kvroute serve`'s HTTP protocol: the bytes
uvicorn's response cycle would write for ``http.response.start`` followed by one
``http.response.body`` with the whole body, built and written at once.

The proxy knows a non-streaming answer whole (status, headers as bytes, body) before it
sends anything.  Through ASGI it still costs two messages, and uvicorn's ``send``
checks every header name and value with a regular expression and scans them for
``content-length`` / ``transfer-encoding`` / ``connection`` (about 3.7 us a response,
tests/bench/bench_hot_path.py); here the checks are one search over all the names and
one over all the values, and the write goes out at once (one ``send()``, no callback
at the end of the loop step).

:func:`send_whole` applies only where it is exactly equivalent: ``send`` is the
``send`` of uvicorn's httptools response cycle on
:class:`~router.proxy.protocol.OneWriteHttpToolsProtocol`'s transport, the response has
not started, the request is not HEAD, no access log is written by uvicorn, the
transport is not paused for writing, and the headers carry none of
``content-length`` / ``transfer-encoding`` / ``connection`` (it sets the length itself).
Anywhere else it returns False and the caller sends the ASGI messages.
tests/router/test_serve_conformance.py checks the bytes against uvicorn's own.
"""

from __future__ import annotations

from typing import Any

from uvicorn.protocols.http.httptools_impl import (
    HEADER_RE,
    HEADER_VALUE_RE,
    STATUS_LINE,
    RequestResponseCycle,
)

from router.proxy.protocol import OneWriteTransport

#: header names that change the framing or the connection: left to uvicorn's own path
_FRAMING = frozenset({b"content-length", b"transfer-encoding", b"connection"})


def send_whole(send: Any, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bool:
    """Write ``status``, ``headers`` (lowercase names), ``content-length`` and ``body``
    as uvicorn would, in one write; False (nothing done) where that is not exactly
    equivalent (see the module docstring)."""
    cycle = getattr(send, "__self__", None)
    if type(cycle) is not RequestResponseCycle:
        return False
    transport = cycle.transport
    if (
        type(transport) is not OneWriteTransport
        or cycle.response_started
        or cycle.disconnected
        or cycle.access_log
        or cycle.flow.write_paused
        or cycle.scope["method"] == "HEAD"
        or status in (204, 304)
        or status not in STATUS_LINE
    ):
        return False
    every = cycle.default_headers + headers
    names, values = zip(*every, strict=True) if every else ((), ())
    joined = b"".join(names)
    if (
        joined != joined.lower()
        or not _FRAMING.isdisjoint(names)
        or HEADER_RE.search(joined) is not None
        or HEADER_VALUE_RE.search(b"\t".join(values)) is not None
    ):
        return False  # uvicorn's path: it lowercases, frames, or refuses the header
    parts = [STATUS_LINE[status]]
    parts += [n + b": " + v + b"\r\n" for n, v in every]
    keep_alive = cycle.keep_alive
    parts.append(b"content-length: %d\r\n" % len(body))
    if not keep_alive:
        parts.append(b"connection: close\r\n")
    parts.append(b"\r\n")
    parts.append(body)
    cycle.response_started = True
    cycle.waiting_for_100_continue = False
    cycle.chunked_encoding = False
    cycle.expected_content_length = 0
    cycle.response_complete = True
    transport.write_now(b"".join(parts))  # the whole response: no wait for the step's end
    cycle.message_event.set()
    if not keep_alive:
        transport.close()
    cycle.on_response()
    return True
