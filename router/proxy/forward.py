"""Forwarding a decided request to its pod: one pooled HTTP/1.1 client, retry before the
first byte, failover of requests stalled before their first byte, streaming passthrough,
cancellation on client disconnect.

Semantics:

* **Retry** — an attempt fails *before any byte reached the client* when connecting
  fails (refused, connect timeout) or the pod answers 502/503.  Then the request goes to
  the next pod of the ranking (at most ``proxy.retries`` times).  Once a response status
  other than 502/503 arrived, the request is committed to that pod: nothing is retried
  after bytes went out.  The final 502/503 of the last attempt is passed through.
* **Failover** — an attempt still waiting for its pod's *first byte* is cancelled there
  (its connection closed: the engine aborts the request) and re-sent to the next pod of
  the ranking when its pod is ejected by health checks (``pod_ejected``), leaves the
  registry (``pod_removed``), or, for a streaming request, when
  ``proxy.first_byte_timeout_s`` passes (``first_byte_timeout``).  The first byte is:

  - streaming (``"stream": true``, or an SSE answer): the first byte of the *body*, i.e.
    the first SSE event, which vLLM sends after queueing and prefill (its head comes at
    once, before the engine saw the request).  The head is held until that first body
    byte, so nothing reaches the client before it and the request may still move;
  - non-streaming: the response head, which vLLM sends with the whole answer.  No
    first-byte deadline applies (a long generation is legitimate; ``read_timeout_s``
    bounds the wait); only ejection or removal moves it.

  A request fails over at most once (a request that stalls on two pods is more likely
  the request's doing than two pods'): the second stall answers 504
  ``first_byte_timeout`` or 502 ``pod_ejected`` / ``pod_removed``.  A failover takes one
  of the ``proxy.retries`` (with 0, none happens) and is counted in
  ``kvroute_retries_total{reason}`` with its cause and in
  ``kvroute_upstream_errors_total{pod, reason}``.  A request that committed (a byte went
  to the client) is never re-sent.  Streams already relaying on an ejected or removed
  pod are not cut: an ejection may be a false positive (health checks timing out on
  a loaded pod) and a pod leaving discovery is usually draining (a rollout), so cutting
  them would truncate answers that would complete.  But from then on such a stream
  ends (truncated, ``stream_broken``) once its pod sends nothing for
  ``proxy.ejected_stream_idle_s``, not ``read_timeout_s``: a vLLM engine shut down
  with SIGTERM keeps its connections open and silent.
* **Streaming** — the upstream body is relayed chunk by chunk as it arrives
  (``aiter_raw``), never buffered whole.  TTFT at the router = time from the request's
  arrival to the first body chunk sent.
* **Disconnect** — while waiting for a non-streaming response or a stream's first
  byte, the client connection is watched (:mod:`router.proxy.attempts`); when it
  closes, the upstream request is cancelled (its connection closed, so the engine
  aborts the request).  A streaming response stops, and closes upstream, as
  soon as the server reports the disconnect.
* **Load** — the chosen pod's router-tracked load is held from just before the attempt
  to the end of the response: prefill tokens until the first body chunk (or the whole
  non-streaming body), in-flight until the last.  The policy's ``on_routed`` is called
  as the attempt starts and ``on_complete`` when it ends (a failed attempt ends at once,
  before the retry's ``on_routed``).
* **Errors** — connect failures after the last retry -> 502, read timeout -> 504,
  other transport errors -> 502, a stall of the last attempt -> 504 / 502 (above); all
  as OpenAI error JSON.  Per-request warnings go through :class:`router.logs.RateLimitedLog`.
* **TLS** — an ``https`` pod is dialled with the one :class:`PodTLS` context; the
  handshake is part of connecting, so a refused certificate is a connect failure
  (retried on the next pod, then 502), logged once per pod and cause.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import httpx
from starlette.responses import Response
from starlette.types import Receive

from router.config import ProxySettings
from router.decision.owners import OwnerStore
from router.decision.request import Routed
from router.errors import RouterError
from router.fleet.load import LoadStore, PendingLoad, RequestLoad
from router.fleet.pods import PodRegistry
from router.fleet.tls import PodTLS
from router.fleet.transport import PodTarget, PodTransport, Upstream
from router.logs import RateLimitedLog
from router.metrics import PodMetrics, RouterMetrics
from router.proxy import answers
from router.proxy.attempts import (
    CLIENT_DISCONNECTED,
    FIRST_BYTE_TIMEOUT,
    POD_EJECTED,
    POD_REMOVED,
    AttemptWatch,
    Disconnected,
)
from router.proxy.relay import Once, RawResponse, RelayResponse, UpstreamBroken, relay_chunks
from router.proxy.response_ids import CreatedSniffer, id_from_body
from scoring.policies.base import Policy

if TYPE_CHECKING:
    from router.proxy.disagg import DecodeLeg

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
_DROP_REQUEST_B = frozenset(h.encode() for h in _DROP_REQUEST)


#: kinds routed without a prompt to tokenize: no prompt or cached tokens to count
_NO_PROMPT_KINDS = frozenset({"embedding", "passthrough"})


def _as_is(err: RouterError) -> RouterError:
    return err


class _Stalled(Exception):
    """An attempt cancelled before its first byte: its pod was ejected or removed, or
    its first-byte deadline passed (``cause``)."""

    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.cause = cause


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
        self._targets: dict[tuple[str, str], PodTarget] = {}
        self._watch = AttemptWatch()
        #: per-request warnings: one line per cause per 10 s
        self._log = RateLimitedLog(log)
        self._connect_timeout = settings.connect_timeout_s
        self._read_timeout = settings.read_timeout_s
        self._first_byte_timeout = settings.first_byte_timeout_s
        #: the upstream bodies relaying per pod (an ejection limits their silence)
        self._relaying: dict[str, set[Any]] = {}
        registry.subscribe_health(self._on_health)
        registry.subscribe(self._on_pod)
        self._drop = _DROP_REQUEST_B | (
            frozenset() if forward_authorization else frozenset({b"authorization"})
        )
        #: where a created response's owner is recorded (``/v1/responses``)
        self.owners: OwnerStore | None = None
        #: what a client may see of an upstream error (tenancy strips fleet internals)
        self.public: Callable[[RouterError], RouterError] = _as_is
        #: called with (tenant, completion tokens) when an answer ends cleanly (limits)
        self.on_answer: Callable[[str | None, int | None], Awaitable[None]] | None = None
        #: the policy reads the output tokens (``on_finished`` is its own): every answer's
        #: usage is decoded for it (else only those reporting cached tokens, for metrics)
        self._policy_wants_output = type(policy).on_finished is not Policy.on_finished
        #: told of every attempt as it starts, like the policy (the speculative entries,
        #: ``RequestRouter.sent``)
        self.on_sent: Callable[[Routed, str], None] | None = None

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

    def _target(self, url: str, path: str) -> PodTarget:
        key = (url, path)
        target = self._targets.get(key)
        if target is None:  # parsing a URL costs more than the rest of the request head
            if len(self._targets) > 4096:
                self._targets.clear()
            target = self._targets[key] = PodTarget(url, path)
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
        leg: DecodeLeg | None = None,
    ) -> Response:
        """Send ``routed`` to its best pod (retrying and failing over as documented) and
        relay the answer.  ``leg``: the decode half of a split request
        (router/proxy/disagg.py) chooses each attempt's body, what is retryable, extra
        response headers and the answer's edit."""
        tail = self._head_tail(headers, len(raw_body))
        retryable = RETRYABLE_STATUS if leg is None else leg.retry_status
        extra = {} if leg is None else leg.header_map
        attempts = routed.ranking[: 1 + self.settings.retries]
        last_error: RouterError | None = None
        failed_over = False
        m = self.metrics
        route = routed.route
        tokens = route.prompt_tokens
        n_attempts = len(attempts)
        first_byte_s = self._first_byte_timeout if routed.stream else None
        for i, pod in enumerate(attempts):
            state = self.registry.get(pod)
            if state is None or (i > 0 and not state.healthy):
                continue  # vanished or ejected between the decision and this attempt
            last = i == n_attempts - 1
            if i > 0:
                m.child(m.retries, last_error.reason if last_error else "unknown").inc()
            if leg is not None:  # P/D: this attempt's body (with or without the params)
                raw_body, tokens = leg.attempt(pod, last_error)
                tail = self._head_tail(headers, len(raw_body))
            pm = m.pod_metrics(routed.model, pod, self.policy_name)
            load = RequestLoad(self.load, pod, tokens)
            # the policy hears of the request now (its in-flight bookkeeping must see it
            # while it runs); the pending overlay covers the shared store's round trip
            self.policy.on_routed(route, pod)
            if self.on_sent is not None:
                self.on_sent(routed, pod)
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
            attempt = self._watch.begin(receive, pod, first_byte_s)
            resp: Upstream | None = None
            try:
                # send; then, unless the answer is retryable (and this is not the last
                # attempt): a stream waits for its first body byte (its head is held
                # until then), anything else is read whole
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
                    if resp.status in retryable and not last:
                        pass  # closed below; the next pod is tried
                    elif routed.stream or resp.is_event_stream:
                        await resp.stream.wait_body()
                    else:  # the head of a non-streaming answer comes with the answer
                        self._watch.commit(attempt)
                        try:
                            content = await resp.stream.read_all()
                        finally:
                            await resp.stream.aclose()
                except asyncio.CancelledError:
                    if resp is not None:
                        await resp.stream.aclose()  # closing cancels it on the pod
                    cause = self._watch.cause(attempt)
                    if cause == CLIENT_DISCONNECTED:
                        raise Disconnected() from None
                    if cause is not None:
                        raise _Stalled(cause) from None
                    raise
                finally:
                    self._watch.end(attempt)
            except Disconnected:
                await self._finish(load, gauge, routed, pod)
                self._served(routed, pod, pm)
                pm.requests(499).inc()
                return Response(status_code=499)
            except _Stalled as stalled:
                await self._finish(load, gauge, routed, pod)
                last_error = self._stall_error(pod, stalled.cause)
                if not failed_over and not last:
                    failed_over = True  # once: a request that stalls twice is not re-sent
                    self._log.warning(
                        ("failover", pod, stalled.cause),
                        "request failed over from pod %s: %s",
                        pod,
                        last_error.message,
                    )
                    continue
                self._served(routed, pod, pm)
                pm.requests(last_error.status).inc()
                return self.public(last_error).response({self.pod_header: pod, **extra})
            except httpx.HTTPError as exc:
                if resp is not None:
                    await resp.stream.aclose()
                await self._finish(load, gauge, routed, pod)
                last_error = self._upstream_error(pod, exc)
                if last_error.reason == "connect":
                    continue  # nothing reached the pod: the next-best one may answer
                self._served(routed, pod, pm)
                pm.requests(last_error.status).inc()
                return self.public(last_error).response({self.pod_header: pod, **extra})

            if content is None and resp.status in retryable and not last:
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
                        await self.remember(rid, pod, routed.tenant)
                if leg is not None:
                    content = leg.edit_body(resp.status, content)
                count = leg is None or leg.count_usage
                answer = answers.of_body(
                    m,
                    routed,
                    pod,
                    resp.status,
                    content,
                    count,
                    want_output=self._policy_wants_output or self.on_answer is not None,
                )
                if load.local is not None:
                    gauge.dec()
                    load.end_now()
                    if answer.ok:
                        self.policy.on_finished(route, pod, answer.output_tokens)
                    self.policy.on_complete(route, pod)
                    if answer.ok and self.on_answer is not None:
                        await self.on_answer(routed.tenant, answer.output_tokens)
                else:
                    await self._complete(load, gauge, routed, pod, answer)
                pm.requests(resp.status).inc()
                out = self._response_headers(resp, pod, leg)
                out.append((b"content-length", b"%d" % len(content)))
                return RawResponse(resp.status, out, content)
            return self._relay_stream(resp, routed, pod, load, gauge, started, leg)

        err = last_error or RouterError(503, "no pod available", reason="no_pod")
        self._count(routed, attempts[-1] if attempts else "none", err.status)
        return self.public(err).response()

    def _stall_error(self, pod: str, cause: str) -> RouterError:
        """The OpenAI error for an attempt cancelled before its first byte: 504
        ``first_byte_timeout``, 502 ``pod_ejected`` / ``pod_removed``; counted by pod and
        reason (except for a removed pod: its series were just dropped from /metrics)."""
        if cause != POD_REMOVED:
            m = self.metrics
            m.child(m.upstream_errors, pod, cause).inc()
        if cause == FIRST_BYTE_TIMEOUT:
            return RouterError(
                504,
                f"pod {pod} sent no first byte within {self._first_byte_timeout:g} s "
                "(proxy.first_byte_timeout_s)",
                reason=cause,
            )
        what = "was ejected by health checks" if cause == POD_EJECTED else "left the fleet"
        return RouterError(502, f"pod {pod} {what} while the request waited for it", reason=cause)

    def _on_health(self, pod: str, healthy: bool) -> None:
        if not healthy:
            self._fail_pod(pod, POD_EJECTED)

    def _on_pod(self, pod: str, spec: object) -> None:
        if spec is None:
            self._fail_pod(pod, POD_REMOVED)

    def _fail_pod(self, pod: str, cause: str) -> None:
        idle = self.settings.ejected_stream_idle_s
        for body in self._relaying.get(pod, ()):
            limit = getattr(body, "limit_silence", None)  # (a test's transport may lack it)
            if limit is not None:
                limit(idle)
        n = self._watch.fail_pod(pod, cause)
        if n:
            self._log.warning(
                ("fail_pod", pod, cause),
                "pod %s %s: %d requests still waiting for its first byte are cancelled there "
                "and failed over",
                pod,
                "ejected" if cause == POD_EJECTED else "removed",
                n,
            )

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

    def _response_headers(
        self, resp: Upstream, pod: str, leg: DecodeLeg | None = None
    ) -> list[tuple[bytes, bytes]]:
        out = [*resp.relay_headers, (self._pod_header_b, pod.encode("latin-1"))]
        if leg is not None:
            out.extend(leg.headers)
        return out

    def _relay_stream(
        self,
        resp: Upstream,
        routed: Routed,
        pod: str,
        load: RequestLoad,
        gauge: Any,
        started: float,
        leg: DecodeLeg | None = None,
    ) -> Response:
        count = leg is None or leg.count_usage
        answer = answers.Answer.for_stream(routed, resp.status, count)
        done = Once(self._complete, load, gauge, routed, pod, answer)
        relay = RelayResponse(
            self._stream(resp, routed, pod, load, started, answer, leg),
            status_code=resp.status,
            on_close=done,
        )
        relay.raw_headers = self._response_headers(resp, pod, leg)
        return relay

    async def _stream(
        self,
        resp: Upstream,
        routed: Routed,
        pod: str,
        load: RequestLoad,
        started: float,
        answer: answers.Answer,
        leg: DecodeLeg | None = None,
    ) -> AsyncIterator[bytes]:
        first = True
        status = resp.status
        m = self.metrics
        sniff = (
            CreatedSniffer()
            if routed.kind == "responses" and 200 <= status < 300 and self.owners is not None
            else None
        )
        relaying = self._relaying.setdefault(pod, set())
        relaying.add(resp.stream)
        try:
            source = resp.stream if leg is None else leg.wrap(resp.status, resp.stream)
            async for chunk in source:
                if sniff is not None:
                    # the owner is recorded before the client sees response.created, so
                    # a follow-up sent as soon as it did finds it; the rest is not read
                    rid = sniff.feed(chunk)
                    if rid is not None:
                        await self.remember(rid, pod, routed.tenant)
                    if sniff.done:
                        sniff = None
                if first and chunk:
                    first = False
                    ttft = time.perf_counter() - started
                    m.child(m.ttft_seconds, routed.model, pod).observe(ttft)
                    self.policy.on_first_token(routed.route, pod, ttft)
                    if load.local is not None:
                        load.first_token_now()
                    else:
                        await load.first_token()
                answer.feed(chunk)
                yield chunk
            if 200 <= status < 300:
                answer.finish(m, routed, pod)
        except httpx.HTTPError as exc:
            # bytes may already be out: no retry, no JSON error.  Re-raise so the server
            # aborts the client connection too (no clean end: the client sees truncation)
            status = 502
            m.child(m.upstream_errors, pod, "stream_broken").inc()
            self._log.warning(("stream_broken", pod), "stream from %s broke: %r", pod, exc)
            raise UpstreamBroken(f"stream from pod {pod} broke: {exc!r}") from None
        except asyncio.CancelledError:
            status = 499
            raise
        finally:
            relaying.discard(resp.stream)
            if not relaying:
                self._relaying.pop(pod, None)
            await resp.stream.aclose()
            self._count(routed, pod, status)

    async def remember(self, response_id: str, pod: str, tenant: str | None = None) -> None:
        """Record ``pod`` (and ``tenant``) as the owner of ``response_id`` (a failing store
        is logged, never fails the answer)."""
        if self.owners is None:
            return
        try:
            await self.owners.put(response_id, pod, tenant)
        except Exception as exc:
            self._log.warning(
                "owner_put", "recording the owner of response %s failed: %r", response_id, exc
            )

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
        t = PodTarget(state.spec.url, target, method)
        head = t.lead + self._head_tail(headers, len(body))
        try:
            resp = await self.transport.send_raw(
                t.host, t.port, head, body, self._connect_timeout, self._read_timeout, t.tls
            )
        except httpx.HTTPError as exc:
            raise self._upstream_error(pod, exc) from None
        out = self._response_headers(resp, pod)
        if resp.is_event_stream:
            relay = RelayResponse(
                relay_chunks(resp), status_code=resp.status, on_close=Once(resp.stream.aclose)
            )
            relay.raw_headers = out
            return relay
        try:
            content = await resp.stream.read_all()
        finally:
            await resp.stream.aclose()
        out.append((b"content-length", b"%d" % len(content)))
        return RawResponse(resp.status, out, content)

    async def _complete(
        self, load: RequestLoad, gauge: Any, routed: Routed, pod: str, answer: answers.Answer
    ) -> None:
        gauge.dec()
        if load.local is not None:
            load.end_now()
        else:
            await load.end()
        if answer.ok:
            self.policy.on_finished(routed.route, pod, answer.output_tokens)
        self.policy.on_complete(routed.route, pod)
        if answer.ok and self.on_answer is not None:
            await self.on_answer(routed.tenant, answer.output_tokens)
