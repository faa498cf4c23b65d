"""Forwarding a decided request to its pod: one pooled HTTP/1.1 client, retry before the
first byte, streaming passthrough, cancellation on client disconnect.

Semantics:

* **Retry** — an attempt fails *before any byte reached the client* when connecting
  fails (refused, connect timeout) or the pod answers 502/503.  Then the request goes to
  the next pod of the ranking (at most ``proxy.retries`` times).  Once a response status
  other than 502/503 arrived, the request is committed to that pod: nothing is retried
  after bytes went out.  The final 502/503 of the last attempt is passed through.
* **Streaming** — the upstream body is relayed chunk by chunk as it arrives
  (``aiter_raw``), never buffered whole.  TTFT at the router = time from the request's
  arrival to the first body chunk sent.
* **Disconnect** — while waiting for a non-streaming response, the client connection is
  watched; when it closes, the upstream request is cancelled (its connection closed, so
  the engine aborts the request).  A streaming response stops, and closes upstream, as
  soon as the server reports the disconnect.
* **Load** — the chosen pod's router-tracked load is held from just before the attempt
  to the end of the response: prefill tokens until the first body chunk (or the whole
  non-streaming body), in-flight until the last.  The policy's ``on_routed`` is called
  as the attempt starts and ``on_complete`` when it ends (a failed attempt ends at once,
  before the retry's ``on_routed``).
* **Errors** — connect failures after the last retry -> 502, read timeout -> 504,
  other transport errors -> 502; all as OpenAI error JSON.
* **TLS** — an ``https`` pod is dialled with the one :class:`PodTLS` context; the
  handshake is part of connecting, so a refused certificate is a connect failure
  (retried on the next pod, then 502), logged once per pod and cause.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httptools
import httpx
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from router.config import ProxySettings
from router.decision.core import Routed
from router.decision.responses import CreatedSniffer, OwnerStore, id_from_body
from router.errors import RouterError
from router.fleet.load import LoadStore, PendingLoad, RequestLoad
from router.fleet.pods import PodRegistry
from router.metrics import PodMetrics, RouterMetrics
from scoring.policies.base import Policy

log = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({502, 503})

#: request headers not forwarded (hop-by-hop, or recomputed by the client)
_DROP_REQUEST = frozenset(
    {
        "host",
        "content-length",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "upgrade",
        "proxy-authorization",
        "proxy-connection",
        "accept-encoding",
        "expect",
    }
)
#: response headers not passed back
_DROP_RESPONSE = frozenset(
    {"content-length", "connection", "keep-alive", "transfer-encoding", "date", "server"}
)
_DROP_REQUEST_B = frozenset(h.encode() for h in _DROP_REQUEST)
_DROP_RESPONSE_B = frozenset(h.encode() for h in _DROP_RESPONSE)


_DEFAULT_PORTS = {"http": 80, "https": 443}


class PodTLS:
    """The one TLS client context for ``https`` pods (requests, scrapes, health checks),
    built on first use: loading a trust store takes ~20 ms, and the transport asks for
    it only when it dials an https pod.

    ``ca_file`` replaces the system trust store (only pods whose certificate chains to
    it are trusted); ``verify=False`` checks neither the certificate nor the host name
    (encrypted, but anyone on the path can pose as a pod: insecure).
    """

    def __init__(self, ca_file: str | None = None, verify: bool = True) -> None:
        self.ca_file = ca_file
        self.verify = verify
        self._context: ssl.SSLContext | None = None

    @classmethod
    def from_settings(cls, settings: ProxySettings) -> PodTLS:
        return cls(settings.pod_ca_file, settings.pod_tls_verify)

    def context(self) -> ssl.SSLContext:
        if self._context is None:
            if self.verify:
                ctx = ssl.create_default_context(cafile=self.ca_file)
            else:
                ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            self._context = ctx
        return self._context


def make_client(
    settings: ProxySettings, transport: httpx.AsyncBaseTransport | None = None
) -> httpx.AsyncClient:
    """The one pooled client: keep-alive, HTTP/1.1, configurable timeouts; requests go
    through ``transport`` (a :class:`PodTransport`) or httpx's default pool."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(
            connect=settings.connect_timeout_s,
            read=settings.read_timeout_s,
            write=settings.read_timeout_s,
            pool=settings.connect_timeout_s,
        ),
        limits=httpx.Limits(max_keepalive_connections=settings.max_keepalive, keepalive_expiry=30),
        http1=True,
        http2=False,
        follow_redirects=False,
        trust_env=False,
        transport=transport,
    )


class _Disconnected(Exception):
    pass


class UpstreamBroken(RuntimeError):
    """A pod's streaming response broke after bytes reached the client."""


class _Once:
    """Runs an async callback at most once."""

    __slots__ = ("args", "done", "fn")

    def __init__(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        self.fn = fn
        self.args = args
        self.done = False

    async def __call__(self) -> None:
        if not self.done:
            self.done = True
            await self.fn(*self.args)


class _RelayResponse(StreamingResponse):
    """A streaming response that always runs ``on_close`` (finished, failed or the client
    went away — even before the first chunk, when the body generator never started)."""

    def __init__(self, *args: Any, on_close: _Once, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            await self.on_close()


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


#: a disconnect watcher starts only for attempts still running after this long (most
#: short answers are in by then, and a watcher task costs more than the rest of the
#: attempt's bookkeeping); a client that leaves is noticed at most this much later
WATCH_DISCONNECT_AFTER_S = 0.02


class _Watch:
    """One attempt whose client may go away: the task running it and its ``receive``."""

    __slots__ = ("due", "gone", "receive", "task", "watcher")

    def __init__(self, task: asyncio.Task[Any], receive: Receive, due: float) -> None:
        self.task = task
        self.receive = receive
        self.due = due
        self.gone = False
        self.watcher: asyncio.Task[None] | None = None


class DisconnectWatch:
    """Cancels an attempt when its client disconnects, listening (a task reading
    ``receive`` until ``http.disconnect``) only for attempts still running after
    ``after_s``.

    One loop timer serves every attempt: it is armed for the earliest attempt due and,
    when it fires, starts the watchers of the attempts due and re-arms for the next one
    (a timer per attempt cost more than the rest of the attempt's bookkeeping).  Use::

        w = watch.begin(receive)
        try:
            ... await the upstream ...
        except asyncio.CancelledError:
            if watch.gone(w): raise _Disconnected   # the client left
            raise
        finally:
            watch.end(w)
    """

    def __init__(self, after_s: float = WATCH_DISCONNECT_AFTER_S) -> None:
        self.after_s = after_s
        self._live: set[_Watch] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def begin(self, receive: Receive) -> _Watch:
        task = asyncio.current_task()
        assert task is not None
        loop = task.get_loop()
        w = _Watch(task, receive, loop.time() + self.after_s)
        self._live.add(w)
        if self._timer is None or self._loop is not loop:  # (a timer of a closed loop)
            self._loop = loop
            self._timer = loop.call_at(w.due, self._sweep, loop)
        return w

    def end(self, w: _Watch) -> None:
        self._live.discard(w)
        if w.watcher is not None:
            w.watcher.cancel()
            w.watcher = None

    def gone(self, w: _Watch) -> bool:
        """True when ``w``'s client disconnected (its task was cancelled for that; the
        cancellation is withdrawn here)."""
        if w.gone:
            w.task.uncancel()
            return True
        return False

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        now = loop.time()
        nxt: float | None = None
        for w in self._live:
            if w.watcher is not None:
                continue
            if w.due <= now:
                w.watcher = loop.create_task(_wait_disconnect(w.receive))
                w.watcher.add_done_callback(functools.partial(_on_disconnect, w))
            elif nxt is None or w.due < nxt:
                nxt = w.due
        if nxt is not None:
            self._timer = loop.call_at(nxt, self._sweep, loop)


def _on_disconnect(w: _Watch, t: asyncio.Task[None]) -> None:
    if w.watcher is not t or t.cancelled() or t.exception() is not None:
        return  # the attempt ended first (or the watcher failed)
    w.gone = True
    w.task.cancel()


#: kinds routed without a prompt to tokenize: no prompt or cached tokens to count
_NO_PROMPT_KINDS = frozenset({"embedding", "passthrough"})


class _RawResponse(Response):
    """A complete response sent as two ASGI messages with pre-built raw headers
    (no header normalisation: the hot path already holds them as bytes)."""

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        self.status_code = status
        self.body = body
        self.raw_headers = headers
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        await send({"type": "http.response.body", "body": self.body})


class _Target:
    """A pod endpoint, parsed once: where to connect (and whether over TLS) and the
    head's first two lines."""

    __slots__ = ("host", "lead", "port", "tls")

    def __init__(self, url: str, path: str, method: bytes = b"POST") -> None:
        parsed = httpx.URL(url.rstrip("/") + path)
        if parsed.scheme not in _DEFAULT_PORTS:
            raise httpx.UnsupportedProtocol(
                f"the pod transport speaks http and https only, not {parsed.scheme!r} ({url})"
            )
        self.host: str = parsed.host
        self.port: int = parsed.port or _DEFAULT_PORTS[parsed.scheme]
        self.tls = parsed.scheme == "https"
        self.lead = (
            method + b" " + parsed.raw_path + b" HTTP/1.1\r\nhost: " + parsed.netloc + b"\r\n"
        )


class Proxy:
    def __init__(
        self,
        client: httpx.AsyncClient,
        settings: ProxySettings,
        registry: PodRegistry,
        load: LoadStore,
        policy: Policy,
        metrics: RouterMetrics,
        *,
        policy_name: str,
        pod_header: str,
        forward_authorization: bool,
        pending: PendingLoad | None = None,
        transport: PodTransport | None = None,
    ) -> None:
        self.client = client
        self.settings = settings
        self.registry = registry
        self.load = load
        self.policy = policy
        self.metrics = metrics
        self.policy_name = policy_name
        self.pod_header = pod_header
        self._pod_header_b = pod_header.lower().encode("latin-1")
        self.forward_authorization = forward_authorization
        self.pending = pending if pending is not None else PendingLoad()
        #: requests go straight to this transport as bytes (httpx's request / response
        #: objects and client layers cost more than the rest of the proxying)
        self._own_transport = transport is None
        self.transport = transport or PodTransport(
            settings.max_keepalive, PodTLS.from_settings(settings)
        )
        self._targets: dict[tuple[str, str], _Target] = {}
        self._watch = DisconnectWatch()
        self._connect_timeout = settings.connect_timeout_s
        self._read_timeout = settings.read_timeout_s
        self._drop = _DROP_REQUEST_B | (
            frozenset() if forward_authorization else frozenset({b"authorization"})
        )
        #: where a created response's owner is recorded (``/v1/responses``)
        self.owners: OwnerStore | None = None

    async def aclose(self) -> None:
        """Close the transport if this proxy made its own."""
        if self._own_transport:
            await self.transport.aclose()

    def _head_tail(self, incoming: list[tuple[bytes, bytes]], length: int) -> bytes:
        """The forwarded headers (hop-by-hop and Host dropped), Content-Length, identity
        encoding and the blank line: everything of the head after the Host line."""
        drop = self._drop
        parts = [k + b": " + v for k, v in incoming if k.lower() not in drop]
        parts.append(b"content-length: %d\r\naccept-encoding: identity\r\n\r\n" % length)
        return b"\r\n".join(parts)

    def _target(self, url: str, path: str) -> _Target:
        key = (url, path)
        target = self._targets.get(key)
        if target is None:  # parsing a URL costs more than the rest of the request head
            if len(self._targets) > 4096:
                self._targets.clear()
            target = self._targets[key] = _Target(url, path)
        return target

    def _count(self, routed: Routed, pod: str, status: int) -> None:
        self.metrics.pod_metrics(routed.model, pod, self.policy_name).requests(status).inc()

    def _served(self, routed: Routed, pod: str, pm: PodMetrics | None = None) -> None:
        """Prompt tokens and predicted cached tokens, labelled with the pod the request
        was finally sent to (after a retry: the retry's pod, not the first choice)."""
        if routed.kind in _NO_PROMPT_KINDS or pod not in routed.views:
            return
        if pm is None:
            pm = self.metrics.pod_metrics(routed.model, pod, self.policy_name)
        pm.served(routed.route.prompt_tokens, routed.cached_tokens(pod))

    async def forward(
        self,
        routed: Routed,
        path: str,
        raw_body: bytes,
        headers: list[tuple[bytes, bytes]],
        receive: Receive,
        started: float,
    ) -> Response:
        """Send ``routed`` to its best pod (retrying as documented) and relay the answer."""
        tail = self._head_tail(headers, len(raw_body))
        attempts = routed.ranking[: 1 + self.settings.retries]
        last_error: RouterError | None = None
        m = self.metrics
        route = routed.route
        tokens = route.prompt_tokens
        n_attempts = len(attempts)
        for i, pod in enumerate(attempts):
            state = self.registry.get(pod)
            if state is None:  # vanished between decision and send
                continue
            last = i == n_attempts - 1
            if i > 0:
                m.child(m.retries, last_error.reason if last_error else "unknown").inc()
            pm = m.pod_metrics(routed.model, pod, self.policy_name)
            load = RequestLoad(self.load, pod, tokens)
            # the policy hears of the request now (its in-flight bookkeeping must see it
            # while it runs); the pending overlay covers the shared store's round trip
            self.policy.on_routed(route, pod)
            if load.local is not None:
                load.begin_now()
            else:
                self.pending.add(pod, tokens)
                try:
                    await load.begin()
                finally:
                    self.pending.remove(pod, tokens)
            gauge = pm.inflight
            gauge.inc()
            watch = self._watch.begin(receive)
            try:
                # send; unless the answer is retryable (and this is not the last
                # attempt) or a stream, read the whole body too
                try:
                    target = self._target(state.spec.url, path)
                    resp = await self.transport.send_raw(
                        target.host,
                        target.port,
                        target.lead + tail,
                        raw_body,
                        self._connect_timeout,
                        self._read_timeout,
                        target.tls,
                    )
                    content: bytes | None = None
                    if not (
                        (resp.status in RETRYABLE_STATUS and not last)
                        or routed.stream
                        or resp.is_event_stream
                    ):
                        try:
                            content = await resp.stream.read_all()
                        finally:
                            await resp.stream.aclose()
                except asyncio.CancelledError:
                    if self._watch.gone(watch):
                        raise _Disconnected() from None
                    raise
                finally:
                    self._watch.end(watch)
            except _Disconnected:
                await self._finish(load, gauge, routed, pod)
                self._served(routed, pod, pm)
                pm.requests(499).inc()
                return Response(status_code=499)
            except httpx.HTTPError as exc:
                await self._finish(load, gauge, routed, pod)
                last_error = self._upstream_error(pod, exc)
                if last_error.reason == "connect":
                    continue  # nothing reached the pod: the next-best one may answer
                self._served(routed, pod, pm)
                pm.requests(last_error.status).inc()
                return last_error.response({self.pod_header: pod})

            if content is None and resp.status in RETRYABLE_STATUS and not last:
                await resp.stream.aclose()
                await self._finish(load, gauge, routed, pod)
                m.child(m.upstream_errors, pod, f"status_{resp.status}").inc()
                last_error = RouterError(
                    resp.status,
                    f"pod {pod} answered {resp.status}",
                    reason=f"status_{resp.status}",
                )
                continue
            self._served(routed, pod, pm)
            if content is not None:
                if routed.kind == "responses" and 200 <= resp.status < 300:
                    rid = id_from_body(content)
                    if rid is not None:
                        await self.remember(rid, pod)
                if load.local is not None:
                    gauge.dec()
                    load.end_now()
                    self.policy.on_complete(route, pod)
                else:
                    await self._complete(load, gauge, routed, pod)
                pm.requests(resp.status).inc()
                out = self._response_headers(resp, pod)
                out.append((b"content-length", b"%d" % len(content)))
                return _RawResponse(resp.status, out, content)
            return self._relay_stream(resp, routed, pod, load, gauge, started)

        self._count(routed, attempts[-1] if attempts else "none", 502)
        err = last_error or RouterError(503, "no pod available", reason="no_pod")
        return err.response()

    def _upstream_error(self, pod: str, exc: httpx.HTTPError) -> RouterError:
        """The OpenAI error for a failed exchange with ``pod`` (counted by reason):
        502 ``connect`` (nothing was sent), 504 ``upstream_timeout``, 502 ``transport``."""
        m = self.metrics
        if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)):
            m.child(m.upstream_errors, pod, "connect").inc()
            return RouterError(502, f"cannot connect to pod {pod}: {exc!r}", reason="connect")
        if isinstance(exc, httpx.TimeoutException):
            m.child(m.upstream_errors, pod, "timeout").inc()
            return RouterError(504, f"pod {pod} did not answer in time", reason="upstream_timeout")
        m.child(m.upstream_errors, pod, "transport").inc()
        return RouterError(502, f"pod {pod} failed: {exc!r}", reason="transport")

    async def _finish(self, load: RequestLoad, gauge: Any, routed: Routed, pod: str) -> None:
        """An attempt that failed before relaying: undo its load and bookkeeping."""
        gauge.dec()
        self.policy.on_complete(routed.route, pod)
        if load.local is not None:
            load.end_now()
        else:
            await load.end()

    def _response_headers(self, resp: _Upstream, pod: str) -> list[tuple[bytes, bytes]]:
        return [*resp.relay_headers, (self._pod_header_b, pod.encode("latin-1"))]

    def _relay_stream(
        self,
        resp: _Upstream,
        routed: Routed,
        pod: str,
        load: RequestLoad,
        gauge: Any,
        started: float,
    ) -> Response:
        done = _Once(self._complete, load, gauge, routed, pod)
        relay = _RelayResponse(
            self._stream(resp, routed, pod, load, started),
            status_code=resp.status,
            on_close=done,
        )
        relay.raw_headers = self._response_headers(resp, pod)
        return relay

    async def _stream(
        self, resp: _Upstream, routed: Routed, pod: str, load: RequestLoad, started: float
    ) -> AsyncIterator[bytes]:
        first = True
        status = resp.status
        m = self.metrics
        sniff = (
            CreatedSniffer()
            if routed.kind == "responses" and 200 <= status < 300 and self.owners is not None
            else None
        )
        try:
            async for chunk in resp.stream:
                if sniff is not None:
                    # the owner is recorded before the client sees response.created, so
                    # a follow-up sent as soon as it did finds it; the rest is not read
                    rid = sniff.feed(chunk)
                    if rid is not None:
                        await self.remember(rid, pod)
                    if sniff.done:
                        sniff = None
                if first and chunk:
                    first = False
                    ttft = time.perf_counter() - started
                    m.child(m.ttft_seconds, routed.model, pod).observe(ttft)
                    if load.local is not None:
                        load.first_token_now()
                    else:
                        await load.first_token()
                yield chunk
        except httpx.HTTPError as exc:
            # bytes may already be out: no retry, no JSON error.  Re-raise so the server
            # aborts the client connection too (no clean end: the client sees truncation)
            status = 502
            m.child(m.upstream_errors, pod, "stream_broken").inc()
            log.warning("stream from %s broke: %r", pod, exc)
            raise UpstreamBroken(f"stream from pod {pod} broke: {exc!r}") from None
        except asyncio.CancelledError:
            status = 499
            raise
        finally:
            await resp.stream.aclose()
            self._count(routed, pod, status)

    async def remember(self, response_id: str, pod: str) -> None:
        """Record ``pod`` as the owner of ``response_id`` (a failing store is logged,
        never fails the answer)."""
        if self.owners is None:
            return
        try:
            await self.owners.put(response_id, pod)
        except Exception as exc:
            log.warning("recording the owner of response %s failed: %r", response_id, exc)

    async def relay(
        self,
        pod: str,
        method: bytes,
        target: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes = b"",
    ) -> Response:
        """Send one request as it is to ``pod`` (``target``: path and query) and relay
        the answer: ``GET /v1/responses/{id}`` (JSON, or SSE with ``stream=true``) and
        ``POST .../cancel``.  No retry elsewhere: only this pod holds the response."""
        state = self.registry.get(pod)
        if state is None:
            raise RouterError(502, f"pod {pod} is gone", reason="no_pod")
        t = _Target(state.spec.url, target, method)
        head = t.lead + self._head_tail(headers, len(body))
        try:
            resp = await self.transport.send_raw(
                t.host, t.port, head, body, self._connect_timeout, self._read_timeout, t.tls
            )
        except httpx.HTTPError as exc:
            raise self._upstream_error(pod, exc) from None
        out = self._response_headers(resp, pod)
        if resp.is_event_stream:
            relay = _RelayResponse(
                _chunks(resp), status_code=resp.status, on_close=_Once(resp.stream.aclose)
            )
            relay.raw_headers = out
            return relay
        try:
            content = await resp.stream.read_all()
        finally:
            await resp.stream.aclose()
        out.append((b"content-length", b"%d" % len(content)))
        return _RawResponse(resp.status, out, content)

    async def _complete(self, load: RequestLoad, gauge: Any, routed: Routed, pod: str) -> None:
        gauge.dec()
        if load.local is not None:
            load.end_now()
        else:
            await load.end()
        self.policy.on_complete(routed.route, pod)


async def _chunks(resp: _Upstream) -> AsyncIterator[bytes]:
    try:
        async for chunk in resp.stream:
            yield chunk
    finally:
        await resp.stream.aclose()


# -- the transport ---------------------------------------------------------------------------

#: a streaming body buffered beyond this (the client reads slower than the pod writes)
#: pauses reading from the pod until the relay catches up
_PAUSE_ABOVE = 1 << 20


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
        #: the headers a relay passes back (hop-by-hop, Date and Server dropped)
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
        if self.buffered > _PAUSE_ABOVE and not self.paused and self.transport is not None:
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
        if lname not in _DROP_RESPONSE_B:
            self.relay_headers.append((name, value))
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

    async def read_all(self) -> bytes:
        """The whole body."""
        conn = self._conn
        taken: list[bytes] = []
        while not conn.complete:
            self._check()
            if conn.paused:  # over _PAUSE_ABOVE: take what is buffered, read on
                taken += conn.take()
            await conn.wait(self._timeout)
        chunks = conn.take()
        if taken:
            chunks = taken + chunks
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

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
        if scheme not in _DEFAULT_PORTS:
            raise httpx.UnsupportedProtocol(
                f"the pod transport speaks http and https only, not {scheme!r}"
            )
        timeouts = request.extensions.get("timeout", {})
        up = await self.send_raw(
            request.url.host,
            request.url.port or _DEFAULT_PORTS[scheme],
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
    ) -> _Upstream:
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
    ) -> _Upstream:
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
        return _Upstream(conn.status, conn.headers, stream, conn.event_stream, conn.relay_headers)

    async def aclose(self) -> None:
        self._closed = True
        for origin in self._origins.values():
            for conn in origin.idle:
                conn.close()
            origin.idle.clear()


class _Upstream:
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
        #: ``headers`` less the hop-by-hop ones, Date and Server
        self.relay_headers = (
            relay_headers
            if relay_headers is not None
            else [(k, v) for k, v in headers if k.lower() not in _DROP_RESPONSE_B]
        )


class _StaleConnection(Exception):
    """A reused keep-alive connection was closed by the pod before answering."""
