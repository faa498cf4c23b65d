"""Server-sent events read as a pod's stream comes, for the parts of the proxy that look
inside one (:mod:`.assemble`, :mod:`.responses_answer`, :mod:`.response_ids`,
:mod:`.first_output`): complete events, a feed of them to a reader, the payload of an
event's ``data:`` lines, and its type."""

from __future__ import annotations

import json


class SseEvents:
    """Complete events from chunks fed as they arrive: the text between blank lines,
    separator dropped, CRLF line ends read as LF.  :attr:`rest` is what has not ended
    yet (a lone trailing CR waits there for its LF)."""

    __slots__ = ("rest",)

    def __init__(self) -> None:
        self.rest = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        n = len(chunk)
        if n > 2 and not self.rest and chunk.find(b"\n\n") == n - 2 and b"\r" not in chunk:
            return [chunk[:-2]]  # (one whole event per chunk: how vLLM's stream arrives)
        buf = self.rest + chunk if self.rest else chunk
        if b"\r" in buf:
            buf = buf.replace(b"\r\n", b"\n")
        events = []
        start = 0
        end = buf.find(b"\n\n")
        while end >= 0:
            events.append(buf[start:end])
            start = end + 2
            end = buf.find(b"\n\n", start)
        self.rest = buf[start:] if start else buf
        return events


class EventFeed:
    """Hands each complete SSE event of the chunks fed to :meth:`_event`; :meth:`_flush`
    hands it what is left at the stream's end (an event without its blank line)."""

    __slots__ = ("_events",)

    def __init__(self) -> None:
        self._events = SseEvents()

    def feed(self, chunk: bytes) -> None:
        for event in self._events.feed(chunk):
            self._event(event)

    def _flush(self) -> None:
        rest, self._events.rest = self._events.rest, b""
        if rest.strip():
            self._event(rest)

    def _event(self, event: bytes) -> None:
        raise NotImplementedError


def data_of(event: bytes) -> bytes:
    """The payload of ``event``'s ``data:`` lines, joined by LF (b"" when it has none)."""
    if event[:6] == b"data: " and b"\n" not in event:
        return event[6:]  # (vLLM's events: one data line each)
    return b"\n".join(line[5:].strip() for line in event.split(b"\n") if line.startswith(b"data:"))


def event_name(event: bytes) -> bytes | None:
    """An SSE event's type: its last ``event:`` line, else its data's ``type`` (None
    when it has neither)."""
    name = None
    for line in event.split(b"\n"):
        if line.startswith(b"event:"):
            name = line[6:].strip()
    if name is not None:
        return name
    data = data_of(event)
    if not data:
        return None
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    kind = obj.get("type") if isinstance(obj, dict) else None
    return kind.encode() if isinstance(kind, str) else None
