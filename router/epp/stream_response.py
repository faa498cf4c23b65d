"""The response half of an ext_proc stream (steps 3 to 5 of :mod:`router.epp.stream`): the
pod's response headers (the served endpoint, the status, the pod's name; a tenant's 5xx
body replaced by a tenant-facing error), its body chunks (a JSON answer held until its
end or assembled from the stream it was asked as, a stream's usage read or the usage event
the EPP asked for taken back out, a created response's owner recorded) and the request's
completion (the usage, the accounting's end, the tenant's count and tokens).

:class:`ResponseSide` is a part of :class:`router.epp.stream.ExtProcStream` (its base
class, which sets these attributes)."""

from __future__ import annotations

import logging
from typing import Any

from router.epp import protocol as P
from router.epp.accounting import Accounting
from router.epp.assembled import HeldAnswer, whole_answer
from router.epp.picker import EndpointPicker
from router.errors import RouterError, error_body
from router.logs import RateLimitedLog
from router.proxy.hidden_usage import HiddenUsage
from router.proxy.response_ids import CreatedSniffer, id_from_body
from router.tenants.auth import TenantContext
from router.usage import UsageReader

#: the stream's logger (and so its rate limiter): its lines keep their logger name
log = logging.getLogger("router.epp.stream")
#: per-request warnings: one line per cause per 10 s
_LOG = RateLimitedLog(log)


class ResponseSide:
    """What the pod's answer goes through (a base of
    :class:`~router.epp.stream.ExtProcStream`, which sets these attributes)."""

    picker: EndpointPicker
    accounting: Accounting | None
    tenant: TenantContext | None
    finished: bool
    _reader: UsageReader | None
    _hidden: HiddenUsage | None
    _asked_usage: bool
    _replaced: bytes | None
    _pod_body: bytes
    _sniffer: CreatedSniffer | None
    _responses: bool
    _hold: bool
    _whole: HeldAnswer | None
    _held: list[bytes]
    _held_size: int
    _complete_pending: bool

    async def _response_headers(self, req: P.ProcessingRequest) -> list[P.ProcessingResponse]:
        headers = P.header_map(req.response_headers)
        status_text = headers.get(":status", "")
        status = int(status_text) if status_text.isdigit() else 0
        content_type = headers.get("content-type", "")
        event_stream = "text/event-stream" in content_type
        self._hold = "application/json" in content_type
        picker = self.picker
        served = P.served_endpoint(req)
        pod = picker.endpoints.pod(served) if served is not None else None
        if served is not None and pod is None:
            picker.epp.protocol_errors.labels("unknown_served_endpoint").inc()
        accounting = self.accounting
        extra: dict[str, str] = {}
        # with tenants an error names no pod (a pod's name is its address under DNS)
        named = not (picker.tenants.enabled and status >= 400)
        if accounting is not None:
            await accounting.served(pod, status, event_stream)
            pod = accounting.pod
            if event_stream and 200 <= status < 300 and self._asked_usage:
                self._hidden = HiddenUsage()
            else:
                self._reader = UsageReader(event_stream)
            if self._responses and 200 <= status < 300 and event_stream:
                self._sniffer = CreatedSniffer()
        if self._whole is not None:
            if event_stream and 200 <= status < 300 and not req.response_headers.end_of_stream:
                self._whole.held = True  # answered with the whole answer (_assembled)
                return []
            self._whole = None  # not a stream: it goes as it came
        if (
            accounting is not None
            and status >= 500
            and picker.tenants.enabled
            and not req.response_headers.end_of_stream
        ):
            self._reader = None
            self._hold = False  # the replacement goes instead of the pod's first chunk
            err = RouterError(
                status, f"pod {accounting.pod} answered {status}", reason=f"status_{status}"
            )
            public = picker.tenants.public(err)
            self._replaced = P.json_bytes(
                error_body(public.message, public.type, None, public.reason)
            )
            extra.update(
                {"content-type": "application/json", "content-length": str(len(self._replaced))}
            )
        if extra or not named:
            if named and pod is not None:
                extra[picker.settings.pod_header] = pod
            out = [P.headers_response(False, extra or None)]
        else:
            out = [picker.served_answer(pod)]
        if req.response_headers.end_of_stream:
            self._complete_pending = True
        return out

    async def _response_body(self, body: Any) -> list[P.ProcessingResponse]:
        chunk: bytes = body.body
        accounting = self.accounting
        if accounting is not None and chunk:
            await accounting.first_byte(chunk)
            if self._reader is not None:
                self._reader.feed(chunk)
            if self._sniffer is not None:
                rid = self._sniffer.feed(chunk)
                if rid is not None:
                    await self._remember(rid)
                if self._sniffer.done:
                    self._sniffer = None
        eos: bool = body.end_of_stream
        whole = self._whole
        if whole is not None and whole.held:
            whole.feed(chunk)
            if not eos:
                return []
            self._complete_pending = True
            return self._assembled()
        hidden = self._hidden
        if hidden is not None:
            chunk = hidden.feed(chunk) + (hidden.flush() if eos else b"")
        elif self._replaced is not None:  # the pod's 5xx body: logged, never sent on
            if len(self._pod_body) < 512:
                self._pod_body += chunk[: 512 - len(self._pod_body)]
            chunk, self._replaced = self._replaced, b""
            if eos and self._pod_body and accounting is not None:
                _LOG.warning(
                    ("pod_5xx", accounting.pod),
                    "pod %s answered %d, not shown to the tenant: %r",
                    accounting.pod,
                    accounting.status,
                    self._pod_body,
                )
        elif self._hold:
            if chunk:
                self._held.append(chunk)
                self._held_size += len(chunk)
            if not eos and self._held_size < P.BODY_CHUNK:
                return []
            chunk = self._flush_held()
        out = list(P.body_responses(False, chunk, eos))
        if eos:
            self._complete_pending = True
        return out

    def _assembled(self, end_of_stream: bool = True) -> list[P.ProcessingResponse]:
        """The held JSON answer's end (:func:`router.epp.assembled.whole_answer`)."""
        whole, accounting = self._whole, self.accounting
        self._whole = None
        assert whole is not None and accounting is not None
        out, self.finished = whole_answer(whole, self.picker, accounting, end_of_stream)
        return out

    def _flush_held(self) -> bytes:
        """The held chunks of a JSON answer, as one (emptied)."""
        held = self._held
        chunk = held[0] if len(held) == 1 else b"".join(held)
        self._held, self._held_size = [], 0
        return chunk

    async def _complete(self) -> None:
        accounting = self.accounting
        if accounting is None:
            return
        reader = self._reader
        usage = reader.usage() if reader is not None and accounting.status != 499 else None
        if self._hidden is not None and accounting.status != 499:
            usage = self._hidden.usage
        if (
            self._responses
            and reader is not None
            and not reader.event_stream
            and 200 <= accounting.status < 300
        ):
            rid = id_from_body(reader.body())
            if rid is not None:
                await self._remember(rid)
        self.accounting = None
        await accounting.done(usage)
        gate = self.picker.tenants
        if gate.enabled:
            gate.count(self.tenant, accounting.status)
            if usage is not None:
                await gate.on_answer(accounting.routed.tenant, usage.completion_tokens)

    async def _remember(self, response_id: str) -> None:
        accounting = self.accounting
        owners = self.picker.owners
        if accounting is None:
            return
        try:
            await owners.put(response_id, accounting.pod, accounting.routed.tenant)
        except Exception as exc:  # a failing store never fails the answer
            log.warning("recording the owner of response %s failed: %r", response_id, exc)
