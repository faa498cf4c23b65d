"""One ext_proc stream (one HTTP request through the proxy), message by message.

The proxy runs the filter with ``request_body_mode`` and ``response_body_mode``
``FULL_DUPLEX_STREAMED`` (what llm-d and GIE run; ``STREAMED`` and ``BUFFERED`` work
the same way here), headers and trailers ``SEND``:

1. **request headers** — kept; nothing is answered yet (the pick needs the body).
   Headers that end the request (no body) are answered at once with a least-loaded
   pick.
2. **request body chunks** — kept as they came, up to ``proxy.max_body_bytes`` (413
   beyond).  At the end of the body (or at the request trailers) the body is parsed
   once and decided on; the answers are then, in order: the request-headers answer
   naming the endpoints (header and metadata) with the body's Content-Length, and
   the body's chunks sent back byte for byte (split at 62,000 bytes), but for a JSON
   answer's: it asks for a stream (:mod:`router.epp.assembled`).
3. **response headers** — the served endpoint (metadata), the status; answered with
   the pod's name in ``pod_header`` (``x-kvroute-pod``).
4. **response body chunks** — of a JSON answer asked as a stream: assembled, the
   headers held until it is whole; else an event stream's sent back as each arrives
   (a stream is never held); a JSON answer's held until its end (or 62,000 bytes) and sent back
   as one chunk: one message fewer per answer (the pod's HTTP/1.1 answer reaches the
   picker as its body, then an empty end of stream).  The first chunk is the time to
   first token; the usage is read on the way.  A tenant's stream whose client did not
   ask for its usage was asked for it (see below): its usage event is taken back out
   (:class:`router.proxy.hidden_usage.HiddenUsage`: the bytes sent back for a chunk are
   the complete events it ends, the terminal chunk held until the usage event; an
   answer may then carry no bytes; a pod ending its stream with trailers has what was
   held sent before them).
5. the response's end of stream (or trailers) completes the request; a stream that
   ends before it (client gone, proxy reset) completes it as 499.

A decision that fails (bad body, unknown model, no pod) is an ImmediateResponse with
the status and OpenAI error JSON `kvroute serve` would answer.

With tenants (:mod:`router.tenants`) the same rules as `kvroute serve` apply before the
pick: the key (401), the model (404), the request and token buckets (429), and the
tenant's ``cache_salt`` set in the body sent on (its Content-Length follows), and
``stream_options.include_usage`` on a chat or completion stream whose client did not
ask, so that its completion tokens are charged; the error messages are the
tenant-facing ones, and a pod's own 5xx body is replaced by one (its Content-Length and
Content-Type set; the pod's body is logged), as `kvroute serve` does.  The trusted
tenant header is not honoured here (the gRPC peer is the proxy, not a gateway in front
of it).

Steps 1 and 2 are here; 3 to 5, the request's completion with them, are in
:mod:`router.epp.stream_response` (its :class:`~router.epp.stream_response.ResponseSide`
is the base class of :class:`ExtProcStream`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from router.decision.request import Routed
from router.epp import protocol as P
from router.epp.accounting import Accounting
from router.epp.assembled import HeldAnswer
from router.epp.picker import EndpointPicker, route_path
from router.epp.stream_response import ResponseSide
from router.errors import RouterError, error_body
from router.proxy.assemble import assemblable, streamed_body
from router.proxy.hidden_usage import HiddenUsage
from router.proxy.response_ids import CreatedSniffer
from router.tenants.auth import TenantContext
from router.usage import UsageReader

_perf = time.perf_counter
_JSON_ERROR = (("content-type", "application/json"),)


class ExtProcStream(ResponseSide):
    """The state of one ext_proc stream; :meth:`handle` returns what to send back (the
    request's messages here, the response's in :class:`ResponseSide`)."""

    def __init__(self, picker: EndpointPicker) -> None:
        self.picker = picker
        self.started = 0.0
        self.headers: dict[str, str] = {}
        self.subset: list[str] | None = None
        self._chunks: list[bytes] = []
        self._size = 0
        self._saw_body = False
        self._decided = False
        self.accounting: Accounting | None = None
        self._reader: UsageReader | None = None
        #: the usage event the EPP asked for, taken out of the client's stream
        self._hidden: HiddenUsage | None = None
        #: the body sent on asks for the usage its client did not (tenants)
        self._asked_usage = False
        #: a pod's 5xx body is replaced by this tenant-facing error (tenants)
        self._replaced: bytes | None = None
        self._pod_body = b""
        self._sniffer: CreatedSniffer | None = None
        self._responses = False
        #: a JSON answer's chunks, held until its end (or BODY_CHUNK bytes): a JSON
        #: document is of no use to the client before its end, and one chunk sent back
        #: instead of two (the body, then Envoy's empty end of stream) is one message
        #: fewer through the picker's gRPC server
        self._hold = False
        #: a JSON answer asked of its pod as a stream (:mod:`router.epp.assembled`)
        self._whole: HeldAnswer | None = None
        self._held: list[bytes] = []
        self._held_size = 0
        #: the request's tenant (None: tenancy off, or not yet known)
        self.tenant: TenantContext | None = None
        #: an immediate response was sent: the proxy ends the stream
        self.finished = False
        #: bookkeeping that waits until the answers are sent (:meth:`after_send`): the
        #: picked pod whose load is taken, and the request's completion
        self._begin_pod: str | None = None
        self._complete_pending = False

    # -- dispatch --------------------------------------------------------------------

    async def handle(self, req: P.ProcessingRequest) -> list[P.ProcessingResponse]:
        which = req.WhichOneof("request")
        if which == "request_body":
            return await self._request_body(req.request_body)
        if which == "response_body":
            return await self._response_body(req.response_body)
        if which == "request_headers":
            return await self._request_headers(req)
        if which == "response_headers":
            return await self._response_headers(req)
        if which == "request_trailers":
            out = [] if self._decided else await self._decide(end_of_stream=False)
            return out if self.finished else [*out, P.trailers_response(request=True)]
        if which == "response_trailers":  # the answer's end: what was held goes first
            if self._whole is not None and self._whole.held:
                self._complete_pending = True
                out = self._assembled(end_of_stream=False)
                return out if self.finished else [*out, P.trailers_response(request=False)]
            held = self._flush_held()
            if self._hidden is not None:
                held += self._hidden.flush()
            out = list(P.body_responses(False, held, False)) if held else []
            self._complete_pending = True
            return [*out, P.trailers_response(request=False)]
        self.picker.epp.protocol_errors.labels("unknown_message").inc()
        return []

    async def after_send(self) -> None:
        """The bookkeeping :meth:`handle` left until its answers were on their way (the
        front calls it once they are written, before reading on): the picked pod's load
        and the policy's ``on_routed``, the request's completion.  Neither changes an
        answer, so neither delays one."""
        pod, self._begin_pod = self._begin_pod, None
        if pod is not None and self.accounting is not None:
            await self.accounting.begin(pod)
        if self._complete_pending:
            self._complete_pending = False
            await self._complete()

    async def close(self) -> None:
        """The stream ended: a request still open is completed (as 499 when its
        answer did not end)."""
        await self.after_send()
        if self.accounting is not None:  # the answer did not end: the client went away
            self.accounting.status = 499
        await self._complete()

    # -- request -----------------------------------------------------------------------

    async def _request_headers(self, req: P.ProcessingRequest) -> list[P.ProcessingResponse]:
        self.started = _perf()
        self.headers = P.header_map(req.request_headers)
        self.subset = P.subset_hint(req)
        if req.request_headers.end_of_stream:  # no body: nothing to score
            return await self._decide(end_of_stream=True)
        return []

    async def _request_body(self, body: Any) -> list[P.ProcessingResponse]:
        if self._decided:  # a body after the pick (not expected): pass it on
            return list(P.body_responses(True, body.body, body.end_of_stream))
        chunk = body.body
        self._saw_body = True
        if chunk:
            self._size += len(chunk)
            limit = self.picker.settings.proxy.max_body_bytes
            if self._size > limit:
                err = RouterError(
                    413,
                    f"request body larger than {limit} bytes (proxy.max_body_bytes)",
                    reason="body_too_large",
                )
                return [self._reject(self.picker.router.reject(err))]
            self._chunks.append(chunk)
        if body.end_of_stream:
            return await self._decide(end_of_stream=True)
        return []

    async def _decide(self, *, end_of_stream: bool) -> list[P.ProcessingResponse]:
        self._decided = True
        picker = self.picker
        path = route_path(self.headers.get(":path", "/"))
        body = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        try:
            sent, self.tenant, self._asked_usage = await picker.admit(path, body, self.headers)
            if sent is not body:  # the tenant's cache_salt: the body sent on changed
                body, self._chunks, self._size = sent, [sent], len(sent)
            decision = await picker.decide(path, body, self.headers, self.subset, self.tenant)
        except RouterError as err:
            return [self._reject(picker.tenants.public(err))]
        if isinstance(decision, Routed):
            ranking = decision.ranking
            accounting = self.accounting = Accounting(picker, decision, self.started)
            self._responses = decision.kind == "responses"
            if picker.settings.proxy.stream_json_answers and assemblable(decision):
                body = streamed_body(body, decision.body, decision.kind)
                self._chunks, self._size = [body], len(body)
                self._whole = HeldAnswer(decision.kind)
        else:
            ranking, accounting = decision, None
        endpoints = picker.endpoint_list(ranking)
        if not endpoints:  # (every allowed pod is addressable: not expected)
            none = RouterError(503, "no endpoint to send the request to", reason="no_pod")
            return [self._reject(picker.router.reject(none))]
        if accounting is not None:
            self._begin_pod = ranking[0]  # after the pick is sent (after_send)
        picker.epp.streams.labels("picked" if accounting is not None else "passed").inc()
        length = self._size if self._saw_body else None
        out = [P.pick_headers_response(endpoints, length)]
        if self._saw_body:
            out += self._body_echo(end_of_stream)
        self._chunks = []
        return out

    def _body_echo(self, end_of_stream: bool) -> Iterator[P.ProcessingResponse]:
        """The request body as it came (chunks of at most 62,000 bytes); only the
        last carries ``end_of_stream``."""
        chunks = self._chunks or [b""]
        last = len(chunks) - 1
        for i, chunk in enumerate(chunks):
            yield from P.body_responses(True, chunk, end_of_stream and i == last)

    def _reject(self, err: RouterError) -> P.ProcessingResponse:
        self.finished = True
        self.picker.epp.streams.labels("rejected").inc()
        if err.status != 401:  # a 401 was counted when the key was refused
            self.picker.tenants.count(self.tenant, err.status)
        body = P.json_bytes(error_body(err.message, err.type, err.param, err.reason))
        headers = [*_JSON_ERROR, *err.headers.items()]
        return P.immediate_response(err.status, body, headers)
