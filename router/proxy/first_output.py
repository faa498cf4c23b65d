"""Where a Responses API stream's first token is.

vLLM sends ``response.created`` and ``response.in_progress`` as soon as it accepts a
streamed Responses request, before the engine has run it
(``vllm/entrypoints/openai/responses/serving.py``, ``responses_stream_generator``: both
are yielded before the loop over the engine's outputs).  Every later event comes from
the engine's output.  So the first byte of such a stream is no first token: taken as
one, the router timed a TTFT of a few milliseconds whatever the prompt, released the
request's prefill load before the prefill ran, and taught a learning policy that prefill
is instant.  The first token is the first event of another type.  (OpenAI's own API may
also open with ``response.queued``.)
"""

from __future__ import annotations

from router.proxy.sse import SseEvents, data_of, event_name

#: the events a Responses stream sends before the engine's first output
BEFORE_OUTPUT = frozenset({b"response.created", b"response.in_progress", b"response.queued"})


def opening_watch(kind: str) -> FirstOutput | None:
    """A watch for the first output of a 2xx stream of this request kind: a Responses
    stream's; None for the others, whose first byte is their first token."""
    return FirstOutput() if kind == "responses" else None


class FirstOutput:
    """Fed a Responses stream's chunks as they are relayed, says which one carries the
    first event sent after the engine's first output.  Only the events before it are
    read; a stream it cannot read (an event past :attr:`LIMIT` bytes) falls back to
    its first byte, the rule for other streams."""

    #: the first events carry the whole response object (instructions, tools): room for it
    LIMIT = 1 << 20

    __slots__ = ("_events",)

    def __init__(self) -> None:
        self._events = SseEvents()

    def seen_in(self, chunk: bytes) -> bool:
        """True when ``chunk`` holds (or ends) the first output event."""
        for event in self._events.feed(chunk):
            name = event_name(event)
            if name is None:
                if data_of(event):
                    return True  # data with no type: not one of the opening events
                continue  # a comment or an empty event: nothing from the engine
            if name not in BEFORE_OUTPUT:
                return True
        return len(self._events.rest) > self.LIMIT
