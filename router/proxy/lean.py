"""The lean path of `kvroute serve`'s HTTP protocol for the hot endpoints: a ``POST`` to
``/v1/chat/completions`` or ``/v1/completions`` (exactly: no query string) whose body is
declared by Content-Length within ``proxy.max_body_bytes``.

uvicorn starts a request's ASGI task as soon as its head is parsed; the task then waits
in ``receive()`` for the body (an event set per body part, a message dict per call) and
the app reads it again.  Here the protocol
(:class:`~router.proxy.protocol.OneWriteHttpToolsProtocol`) keeps the body while it
arrives and starts the task once it is complete, handing it the body and the headers
as the app's fast path (``_fast`` in :mod:`router.proxy.app`) would have built them.
Everything else is uvicorn's own: the response cycle (``send``, ``receive`` for the
disconnect, keep-alive, flow control) and its task wrapper (``run_asgi``: a failure
before the answer is its 500).  The app behind it is the same code as on the ASGI path
(API keys, tenants, access log, limits, errors, failover, streaming).

The app offers the lean path only without tenants, router API keys or an access log:
a client that leaves (or is refused, 408) before its body is complete then runs no
handler, where through ASGI the handler would have run on the partial request and
answered a closed connection; with any of the three that run is observed (a tenant's
count, an API key's 401, a log line).  One difference remains: through ASGI a client
that leaves before any body byte arrived is counted as an ``invalid_json`` bad request
(its body reads as empty); on the lean path it is not counted.

Any other request (another method or path, a query string, HTTP/1.0, ``Expect:
100-continue``, a chunked or undeclared or too large body, a request pipelined behind
one still answering, uvicorn's ``root_path`` or ``limit_concurrency``, an app wrapped
in middleware) takes uvicorn's path.  tests/router/test_serve_conformance.py compares
the lean path's bytes with uvicorn's.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

#: the app's handler: (scope, receive, send, kind, path, headers, body)
LeanHandler = Callable[..., Awaitable[None]]


@dataclass(frozen=True)
class LeanRoutes:
    """What an app takes on the lean path: request target -> (kind, path), the largest
    declared body, and its handler."""

    routes: dict[bytes, tuple[str, str]]
    max_body: int
    handler: LeanHandler


def lean_routes_of(app: Any, root_path: str, limit_concurrency: int | None) -> LeanRoutes | None:
    """``app``'s lean routes, or None (no such attribute, or uvicorn settings the lean
    path does not reproduce).  ``app`` is uvicorn's loaded app: a middleware wrapping
    the router app (proxy headers...) hides them, so that its work is never skipped."""
    lean = getattr(app, "lean_routes", None)
    if not isinstance(lean, LeanRoutes) or root_path or limit_concurrency is not None:
        return None
    return lean


def lean_begin(
    protocol: HttpToolsProtocol, lean: LeanRoutes
) -> tuple[str, str, dict[str, str]] | None:
    """Called when the head of a request to one of ``lean``'s paths is complete: when the
    request qualifies (the module docstring), its scope is filled in and its response
    cycle made as uvicorn makes them (its task is started by the protocol once the body
    is here) -> (kind, path, headers); else None (nothing done: the request is
    uvicorn's)."""
    parser = protocol.parser
    cycle = protocol.cycle
    if (
        protocol.expect_100_continue
        or (cycle is not None and not cycle.response_complete)  # pipelined: queued
        or parser.get_method() != b"POST"
        or parser.get_http_version() != "1.1"
        or parser.should_upgrade()
    ):
        return None
    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in protocol.headers}
    declared = headers.get("content-length")
    if (
        declared is None
        or "transfer-encoding" in headers
        or not declared.isdigit()
        or int(declared) > lean.max_body
    ):
        return None  # the app reads (and limits) such a body as it comes
    url = protocol.url
    kind, path = lean.routes[url]
    scope = protocol.scope
    scope["method"] = "POST"
    scope["path"] = path
    scope["raw_path"] = url
    scope["query_string"] = b""
    scope["app"] = protocol.app  # type: ignore[typeddict-unknown-key]  # as the app's fast path does
    protocol.cycle = RequestResponseCycle(
        scope=scope,
        transport=protocol.transport,
        flow=protocol.flow,
        logger=protocol.logger,
        access_logger=protocol.access_logger,
        access_log=protocol.access_log,
        default_headers=protocol.server_state.default_headers,
        message_event=asyncio.Event(),
        expect_100_continue=False,
        keep_alive=parser.should_keep_alive(),
        on_response=protocol.on_response_complete,
    )
    return kind, path, headers


def run_lean(
    handler: LeanHandler,
    cycle: RequestResponseCycle,
    kind: str,
    path: str,
    headers: dict[str, str],
    body: bytes,
) -> Coroutine[Any, Any, None]:
    """The task of a lean request: ``handler`` run as uvicorn runs an ASGI app (its
    exceptions and unfinished answers handled by ``run_asgi``)."""
    app = functools.partial(handler, kind=kind, path=path, headers=headers, body=body)
    return cycle.run_asgi(app)
