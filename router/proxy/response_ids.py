"""Finding a stored response's id in a pod's answer, as the proxy relays it: the JSON
body's ``id``, or a stream's ``response.created`` event (so the owner is recorded before
the client sees that event)."""

from __future__ import annotations

import json

from router.proxy.sse import SseEvents, data_of, event_name


def id_from_body(content: bytes) -> str | None:
    """``id`` of a non-streaming Responses answer (None when there is none)."""
    try:
        body = json.loads(content)
    except ValueError:
        return None
    rid = body.get("id") if isinstance(body, dict) else None
    return rid if isinstance(rid, str) and rid else None


class CreatedSniffer:
    """Finds the response id in a streaming answer: the ``response.created`` event's
    ``response.id``.  Chunks are fed as they are relayed; only the text up to the end
    of the first events is kept (bounded), and nothing once the id is found."""

    #: give up when the first event is not complete within this many bytes
    LIMIT = 1 << 16

    __slots__ = ("_events", "done", "id")

    def __init__(self) -> None:
        self._events = SseEvents()
        self.done = False
        self.id: str | None = None

    def feed(self, chunk: bytes) -> str | None:
        """The id once found in the stream so far (returned once), else None."""
        if self.done:
            return None
        for event in self._events.feed(chunk):
            rid = _created_id(event)
            if rid is not None or self._event_named_other(event):
                self.done = True
                self._events.rest = b""
                self.id = rid
                return rid
        if len(self._events.rest) > self.LIMIT:
            self.done = True
            self._events.rest = b""
        return None

    @staticmethod
    def _event_named_other(event: bytes) -> bool:
        """A complete event that is not ``response.created``: the id will not come
        (``response.created`` is vLLM's first event)."""
        return any(
            line.startswith(b"data:") or line.startswith(b"event:") for line in event.split(b"\n")
        )


def _created_id(event: bytes) -> str | None:
    if event_name(event) != b"response.created":
        return None
    try:
        obj = json.loads(data_of(event))
    except ValueError:
        return None
    resp = obj.get("response") if isinstance(obj, dict) else None
    rid = resp.get("id") if isinstance(resp, dict) else None
    return rid if isinstance(rid, str) and rid else None
