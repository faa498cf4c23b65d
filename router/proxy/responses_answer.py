"""A Responses API JSON answer assembled from the pod's stream (``proxy.stream_json_answers``,
as :mod:`.assemble` does for chat and text completions).

vLLM builds a stream's last event, ``response.completed``, with the function that builds
its JSON answer (``responses_full_generator`` in
``vllm/entrypoints/openai/responses/serving.py``), so the JSON answer is that event's
``response`` object, taken whole: nothing is merged.  ``response.incomplete`` and
``response.failed`` end a stream the same way, with the response in that state.

Sent as it came, such a request showed the router no first token (the answer comes
whole after its last token).  Streamed, its first token is its first event after the
opening ones (:mod:`.first_output`).  An ``error`` event raises :class:`StreamFailed`;
a stream that ends without a final response, or whose final event is not a JSON
object with a ``response`` object, raises :class:`StreamUnreadable`: a 502, never half
an answer.
"""

from __future__ import annotations

from typing import Any

import msgspec

from router.proxy.assemble import StreamFailed, StreamUnreadable
from router.proxy.sse import EventFeed, data_of, event_name

#: the events that end a Responses stream with the whole response
FINAL = frozenset({b"response.completed", b"response.incomplete", b"response.failed"})
_decode = msgspec.json.Decoder()
_encode = msgspec.json.Encoder()


class ResponsesAssembler(EventFeed):
    """The SSE of one response, read as it comes; :meth:`answer` is the JSON."""

    __slots__ = ("_response",)

    def __init__(self) -> None:
        super().__init__()
        self._response: dict[str, Any] | None = None

    def answer(self) -> bytes:
        """The JSON answer (raises :class:`StreamUnreadable` / :class:`StreamFailed`)."""
        self._flush()
        if self._response is None:
            raise StreamUnreadable("the stream ended without its final response event")
        return _encode.encode(self._response)

    def _event(self, event: bytes) -> None:
        name = event_name(event)
        if name == b"error":
            raise StreamFailed(_message(data_of(event)))
        if name not in FINAL:
            return
        try:
            obj = _decode.decode(data_of(event))
        except msgspec.DecodeError:
            raise StreamUnreadable(f"{name.decode()} is not JSON") from None
        response = obj.get("response") if isinstance(obj, dict) else None
        if not isinstance(response, dict):
            raise StreamUnreadable(f"{name.decode()} carries no response object")
        self._response = response


def _message(data: bytes) -> str:
    """An ``error`` event's message (vLLM: top-level ``message``; else ``error.message``)."""
    try:
        obj = _decode.decode(data)
    except msgspec.DecodeError:
        return "the pod's stream ended with an error"
    if isinstance(obj, dict):
        inner = obj.get("error")
        message = obj.get("message") or (inner.get("message") if isinstance(inner, dict) else None)
        if isinstance(message, str) and message:
            return message
    return "the pod's stream ended with an error"
