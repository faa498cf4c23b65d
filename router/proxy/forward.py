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
    byte, so nothing reaches the client before it and the request may still move.  A
    Responses API stream opens with ``response.created`` and ``response.in_progress``
    before the engine runs the request: it waits, held, for its first event after
    those (:mod:`.first_output`);
  - a JSON answer the router assembles (``proxy.stream_json_answers``: a chat or text
    completion, or a Responses request, asked of its pod as a stream, :mod:`.assemble`,
    :mod:`.responses_answer`): its stream's first token, as a stream's; the answer goes
    to the client whole once the stream ended (a
    stream that gives no whole answer is a 502: ``stream_error``, ``stream_unreadable``,
    or the transport's);
  - a JSON answer of at most one token (``max_tokens`` <= 1): its head, which vLLM
    sends right after that token; it counts as the first token, as a stream's does;
  - any other non-streaming answer: the response head, which vLLM sends with the whole
    answer.  No first-byte deadline applies (a long generation is legitimate;
    ``read_timeout_s`` bounds the wait); only ejection or removal moves it.

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
  to the end of the response: prefill tokens until the first body chunk (or, for a JSON
  answer sent as it came, the whole body; the head of one of at most one token),
  in-flight until the last.  The policy's ``on_routed`` is called as the attempt starts
  and ``on_complete`` when it ends (a failed attempt ends at once, before the retry's
  ``on_routed``).  A complete answer that goes in one write (`kvroute serve`'s
  protocol, :class:`~router.proxy.relay.RawResponse`) is written first: its load,
  hooks, usage and request metrics are settled right after the write, in the same step
  of the event loop, so the client does not wait for them and no other request is
  decided before them (``Bookkeeping._settle``).  With a shared load store or tenants,
  whose updates await, or an answer sent as ASGI messages, they come before it.
* **Errors** — connect failures after the last retry -> 502, read timeout -> 504,
  other transport errors -> 502, a stall of the last attempt -> 504 / 502 (above); all
  as OpenAI error JSON.  Per-request warnings go through :class:`router.logs.RateLimitedLog`.
* **TLS** — an ``https`` pod is dialled with the one :class:`PodTLS` context; the
  handshake is part of connecting, so a refused certificate is a connect failure
  (retried on the next pod, then 502), logged once per pod and cause.

The attempt loop is here (:class:`Proxy`); beside it: the proxy's construction, its
pod targets and forwarded head (:mod:`.wiring`, the head built by :mod:`.head`), the
answer's relay (:mod:`.streaming`), the failures' errors and the pod hooks
(:mod:`.failures`) and the load and policy bookkeeping (:mod:`.bookkeeping`).
"""

from __future__ import annotations

import asyncio
from functools import partial
from typing import TYPE_CHECKING, Any

import httpx
from starlette.responses import Response
from starlette.types import Receive

from router.decision.request import Routed
from router.errors import RouterError
from router.fleet.load import RequestLoad
from router.fleet.transport import Upstream
from router.proxy import answers
from router.proxy.assemble import (
    StreamFailed,
    StreamUnreadable,
    assemblable,
    one_token,
    streamed_body,
    unassembled,
)
from router.proxy.attempts import CLIENT_DISCONNECTED, Disconnected
from router.proxy.failures import RETRYABLE_STATUS, Stalled
from router.proxy.first_output import opening_watch
from router.proxy.relay import RawResponse, pod_5xx_error
from router.proxy.response_ids import id_from_body
from router.proxy.wiring import ProxyWiring

if TYPE_CHECKING:
    from router.proxy.disagg import DecodeLeg

__all__ = ["RETRYABLE_STATUS", "Proxy"]


class Proxy(ProxyWiring):
    """Forwards decided requests to their pods: the attempt loop (retry, failover), with
    its construction, pod targets and forwarded head
    (:class:`~router.proxy.wiring.ProxyWiring`), the answer's relay
    (:class:`~router.proxy.streaming.StreamRelay`), the attempts' errors
    (:class:`~router.proxy.failures.Failures`) and their bookkeeping
    (:class:`~router.proxy.bookkeeping.Bookkeeping`) as its bases."""

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
        # a JSON answer asked of the pod as a stream, assembled here (router/proxy/assemble.py)
        whole = leg is None and self._stream_json and assemblable(routed)
        if whole:
            raw_body = streamed_body(raw_body, routed.body, routed.kind)
        head_first = leg is None and one_token(routed)  # its head is its first token
        # a JSON answer forwarded as it came (a P/D decode leg's too): its first token is
        # not seen here, the pod's count tells when it is past (router/fleet/first_tokens.py)
        ledger = self.first_tokens
        unseen = ledger is not None and not (whole or head_first or routed.stream)
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
        first_byte_s = self._first_byte_timeout if routed.stream or whole or head_first else None
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
            load = RequestLoad(self.load, pod, tokens, ledger)
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
            if unseen and ledger is not None:
                ledger.expect(load, route)
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
                    elif whole and resp.is_event_stream and 200 <= resp.status < 300:
                        watch = opening_watch(routed.kind)  # its first token: committed there
                        await resp.stream.wait_body(watch.seen_in if watch else None)
                        self._watch.commit(attempt)
                        try:
                            content = await self._gather(resp, routed, pod, load, started)
                        finally:
                            await resp.stream.aclose()
                    elif routed.stream or resp.is_event_stream:
                        # a Responses stream: until its first output (module docstring)
                        ok = 200 <= resp.status < 300
                        watch = opening_watch(routed.kind) if ok else None
                        await resp.stream.wait_body(watch.seen_in if watch else None)
                    else:  # the head of a non-streaming answer comes with the answer
                        self._watch.commit(attempt)
                        if head_first and 200 <= resp.status < 300:
                            await self._first_token(routed, pod, load, started)
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
                        raise Stalled(cause) from None
                    raise
                finally:
                    self._watch.end(attempt)
            except Disconnected:
                await self._finish(load, gauge, routed, pod)
                self._served(routed, pod, pm)
                pm.requests(499).inc()
                return Response(status_code=499)
            except Stalled as stalled:
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
            except (StreamUnreadable, StreamFailed) as exc:
                await self._finish(load, gauge, routed, pod)
                err = unassembled(pod, exc, self.metrics, self._log)
                self._served(routed, pod, pm)
                pm.requests(err.status).inc()
                return self.public(err).response({self.pod_header: pod})
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
            if self.hide_pod_errors and resp.status >= 500:
                return await self._pod_error(resp, content, load, gauge, routed, pod, extra)
            if content is not None:
                if routed.kind == "responses" and 200 <= resp.status < 300:
                    rid = id_from_body(content)
                    if rid is not None:
                        await self.remember(rid, pod, routed.tenant)
                if leg is not None:
                    content = leg.edit_body(resp.status, content)
                count = leg is None or leg.count_usage
                if whole and resp.is_event_stream:
                    out = self._whole_headers(resp, pod)
                else:
                    out = self._response_headers(resp, pod, leg)
                if load.local is not None and self.on_answer is None:
                    # nothing of its bookkeeping awaits: it runs once the client has
                    # the answer, in the same step of the loop (bookkeeping.py)
                    settle = partial(
                        self._settle, routed, pod, pm, load, gauge, resp.status, content, count
                    )
                    return RawResponse(resp.status, out, content, settle)
                self._served(routed, pod, pm)
                answer = answers.of_body(
                    m,
                    routed,
                    pod,
                    resp.status,
                    content,
                    count,
                    want_output=self._policy_wants_output or self.on_answer is not None,
                )
                await self._complete(load, gauge, routed, pod, answer)
                pm.requests(resp.status).inc()
                return RawResponse(resp.status, out, content)
            self._served(routed, pod, pm)
            return self._relay_stream(resp, routed, pod, load, gauge, started, leg)

        err = last_error or RouterError(503, "no pod available", reason="no_pod")
        self._count(routed, attempts[-1] if attempts else "none", err.status)
        return self.public(err).response()

    async def _pod_error(
        self,
        resp: Upstream,
        content: bytes | None,
        load: RequestLoad,
        gauge: Any,
        routed: Routed,
        pod: str,
        extra: dict[str, str],
    ) -> Response:
        """A pod's 5xx answer, not relayed (:attr:`hide_pod_errors`): its body is
        logged and the client gets the public form of ``status_<code>``."""
        err = await pod_5xx_error(resp, content, pod)
        await self._finish(load, gauge, routed, pod)
        self._served(routed, pod)
        self._count(routed, pod, resp.status)
        return self.public(err).response({self.pod_header: pod, **extra})
