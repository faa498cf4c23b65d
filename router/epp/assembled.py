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

from router.proxy.assemble import Assembler, StreamFailed, StreamUnreadable
from router.proxy.responses_answer import ResponsesAssembler


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
