"""Relaying a pod's answer to the client: a stream chunk by chunk (its first chunk is the
request's TTFT at the router, its usage read from the tail), the owner of a created
response recorded before the client sees it, and a request sent as it is to the one pod
that holds a stored response (see "Streaming" and "Load" in :mod:`router.proxy.forward`).

:class:`StreamRelay` is a part of :class:`router.proxy.forward.Proxy` (its base class)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import httpx
from starlette.responses import Response

from router.decision.owners import OwnerStore
from router.decision.request import Routed
from router.errors import RouterError
from router.fleet.load import RequestLoad
from router.fleet.pods import PodRegistry
from router.fleet.transport import PodTarget, PodTransport, Upstream
from router.proxy import answers
from router.proxy.assemble import Assembler
from router.proxy.bookkeeping import Bookkeeping
from router.proxy.failures import Failures
from router.proxy.first_output import opening_watch
from router.proxy.head import head_tail
from router.proxy.relay import (
    Once,
    RawResponse,
    RelayResponse,
    UpstreamBroken,
    pod_5xx_error,
    relay_chunks,
)
from router.proxy.response_ids import CreatedSniffer
from router.proxy.responses_answer import ResponsesAssembler

if TYPE_CHECKING:
    from router.proxy.disagg import DecodeLeg


class StreamRelay(Bookkeeping, Failures):
    """The answer's way back to the client (a base of
    :class:`~router.proxy.forward.Proxy`, which sets these attributes)."""

    registry: PodRegistry
    transport: PodTransport
    #: where a created response's owner is recorded (``/v1/responses``)
    owners: OwnerStore | None
    _pod_header_b: bytes
    _drop: frozenset[bytes]
    _connect_timeout: float
    _read_timeout: float
    hide_pod_errors: bool
    _relaying: dict[str, set[Any]]
    on_ttft: Callable[[str | None, float], None] | None

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
        ok = 200 <= status < 300
        m = self.metrics
        sniff = (
            CreatedSniffer()
            if routed.kind == "responses" and 200 <= status < 300 and self.owners is not None
            else None
        )
        # a Responses stream opens with events sent before the engine runs the request
        watch = opening_watch(routed.kind) if ok else None
        relaying = self._relaying.setdefault(pod, set())
        relaying.add(resp.stream)
        try:
            source = answer.wrap(resp.stream if leg is None else leg.wrap(resp.status, resp.stream))
            async for chunk in source:
                if sniff is not None:
                    # the owner is recorded before the client sees response.created, so
                    # a follow-up sent as soon as it did finds it; the rest is not read
                    rid = sniff.feed(chunk)
                    if rid is not None:
                        await self.remember(rid, pod, routed.tenant)
                    if sniff.done:
                        sniff = None
                # (an error's body is no first token; a Responses stream's opening is not)
                if first and chunk and ok and (watch is None or watch.seen_in(chunk)):
                    first = False
                    watch = None
                    await self._first_token(routed, pod, load, started)
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

    async def _first_token(
        self, routed: Routed, pod: str, load: RequestLoad, started: float
    ) -> None:
        """The answer's first body byte came from ``pod``: its TTFT is timed (and told
        to the tenants' row and the policy), and its prefill load is done."""
        ttft = time.perf_counter() - started
        m = self.metrics
        m.child(m.ttft_seconds, routed.model, pod).observe(ttft)
        if self.on_ttft is not None:
            self.on_ttft(routed.tenant, ttft)
        self.policy.on_first_token(routed.route, pod, ttft)
        if load.ledger is not None:
            load.ledger.seen(pod)
        if load.local is not None:
            load.first_token_now()
        else:
            await load.first_token()

    async def _gather(
        self, resp: Upstream, routed: Routed, pod: str, load: RequestLoad, started: float
    ) -> bytes:
        """Read the stream asked for a JSON answer (:mod:`router.proxy.assemble`) to its
        end, its first byte counted as a stream's first token, and return the JSON
        answer.  Its pod's ejection limits its silence, as a relayed stream's."""
        whole = ResponsesAssembler() if routed.kind == "responses" else Assembler(routed.kind)
        watch = opening_watch(routed.kind)
        relaying = self._relaying.setdefault(pod, set())
        relaying.add(resp.stream)
        first = True
        try:
            async for chunk in resp.stream:
                if first and chunk and (watch is None or watch.seen_in(chunk)):
                    first = False
                    await self._first_token(routed, pod, load, started)
                whole.feed(chunk)
        finally:
            relaying.discard(resp.stream)
            if not relaying:
                self._relaying.pop(pod, None)
        return whole.answer()

    def _whole_headers(self, resp: Upstream, pod: str) -> list[tuple[bytes, bytes]]:
        """The headers of an assembled JSON answer: the pod's, with JSON's type."""
        out = [(k, v) for k, v in resp.relay_headers if k != b"content-type"]
        out += [(b"content-type", b"application/json"), (self._pod_header_b, pod.encode("latin-1"))]
        return out

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
        head = t.lead + head_tail(headers, self._drop, len(body))
        try:
            resp = await self.transport.send_raw(
                t.host, t.port, head, body, self._connect_timeout, self._read_timeout, t.tls
            )
        except httpx.HTTPError as exc:
            raise self._upstream_error(pod, exc) from None
        if self.hide_pod_errors and resp.status >= 500:
            raise await pod_5xx_error(resp, None, pod)
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
        return RawResponse(resp.status, out, content)
