"""A JSON answer the picker assembles from its pod's stream (``proxy.stream_json_answers``),
as `kvroute serve` does (:mod:`router.proxy.assemble`): vLLM sends a JSON answer whole,
after its last token, so a picker that lets it through as it came never sees its first
token (no TTFT, the prompt's prefill load held to the end, a learning policy left on its
priors).  ext_proc lets the picker change both directions, so:

1. the request body sent on asks for a stream (:func:`router.proxy.assemble.streamed_body`,
   its Content-Length follows), for the requests `kvroute serve` assembles
   (:func:`router.proxy.assemble.assemblable`);
2. the pod's response headers, when it answers 2xx with an event stream, are held: not
   answered until the answer is whole.  In ``FULL_DUPLEX_STREAMED`` mode Envoy goes on
   sending the body meanwhile and runs no message timer (its ``ProcessorState``
   starts none in that mode), so the hold lasts as long as the answer takes;
3. each body chunk feeds the assembler and nothing goes back; the first is the first
   token, as a stream's (:class:`router.epp.accounting.Accounting`);
4. at the end: the held headers answer, ``content-type: application/json`` and the
   answer's ``content-length`` set, then the JSON answer (in chunks of at most 62,000
   bytes) with the end of stream.  A stream that cannot be assembled (not the SSE of a
   completion, or an ``error`` event) is answered with an immediate 502 and the OpenAI
   error `kvroute serve` answers (Envoy has sent the client nothing yet).

A pod that answers otherwise (an error status, a JSON body) is passed on as it came.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from router.epp import protocol as P
from router.errors import error_body
from router.logs import RateLimitedLog
from router.proxy.assemble import Assembler, StreamFailed, StreamUnreadable, unassembled
from router.proxy.responses_answer import ResponsesAssembler

if TYPE_CHECKING:
    from router.epp.accounting import Accounting
    from router.epp.picker import EndpointPicker

log = logging.getLogger(__name__)
#: one line per cause and pod per 10 s
_LOG = RateLimitedLog(log)
_JSON = ("content-type", "application/json")


class HeldAnswer:
    """One JSON answer being assembled: its pod's stream fed as it comes, the response
    headers held until :meth:`answer`."""

    __slots__ = ("_error", "_whole", "held")

    def __init__(self, kind: str) -> None:
        self._whole = ResponsesAssembler() if kind == "responses" else Assembler(kind)
        self._error: StreamUnreadable | StreamFailed | None = None
        #: the response headers were held (the pod answered 2xx with an event stream)
        self.held = False

    def feed(self, chunk: bytes) -> None:
        """A chunk of the pod's stream (after a failure: dropped)."""
        if self._error is None and chunk:
            try:
                self._whole.feed(chunk)
            except (StreamUnreadable, StreamFailed) as exc:
                self._error = exc

    def answer(self) -> bytes:
        """The JSON answer; raises :class:`StreamUnreadable` / :class:`StreamFailed` when
        the stream was not one of a whole completion."""
        if self._error is not None:
            raise self._error
        return self._whole.answer()


def whole_answer(
    whole: HeldAnswer, picker: EndpointPicker, accounting: Accounting, end_of_stream: bool
) -> tuple[list[P.ProcessingResponse], bool]:
    """The answers that end a held JSON answer, and whether they end the request at once:
    the held response headers (JSON's type, the answer's length, the pod's name) and the
    answer's body; or, for a stream that could not be assembled, an immediate 502 with
    the OpenAI error `kvroute serve` answers (counted in ``kvroute_upstream_errors_total``
    and logged as there; with tenants, the tenant-facing error, naming no pod)."""
    pod = accounting.pod
    try:
        answer = whole.answer()
    except (StreamUnreadable, StreamFailed) as exc:
        err = unassembled(pod, exc, picker.metrics, _LOG)
        accounting.status = err.status
        public = picker.tenants.public(err)
        named = [] if picker.tenants.enabled or not pod else [(picker.settings.pod_header, pod)]
        body = P.json_bytes(error_body(public.message, public.type, None, public.reason))
        return [P.immediate_response(err.status, body, [_JSON, *named])], True
    headers = dict([_JSON, ("content-length", str(len(answer)))])
    if pod:  # (none when the picked pod's bookkeeping failed)
        headers[picker.settings.pod_header] = pod
    out = [P.headers_response(False, headers), *P.body_responses(False, answer, end_of_stream)]
    return out, False
