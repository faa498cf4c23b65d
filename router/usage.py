"""What a front reads in a pod's answer as it passes through: the OpenAI ``usage``
(the EPP as it echoes the answer to Envoy, the proxy as it relays it to the client).

The answer is relayed chunk by chunk and never changed; this keeps only
what it needs to find the usage at the end: the whole body of a JSON answer up to
:data:`JSON_LIMIT` bytes (a larger one is not parsed), or the last :data:`SSE_TAIL`
bytes of a server-sent-event stream (vLLM sends the usage in the last data event when
the request asked ``stream_options.include_usage``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

#: largest JSON answer read for its usage
JSON_LIMIT = 1 << 20
#: bytes of a stream's end kept to find its last usage event
SSE_TAIL = 1 << 14


class _Answer(msgspec.Struct):
    """The two members of an answer (or event) that can hold its usage; msgspec skips
    the others without building them (the choices, the text: most of the bytes)."""

    usage: Any = None
    #: a Responses API event's response object (its usage inside)
    response: Any = None


#: decodes an answer into :class:`_Answer`; a JSON value that is not an object raises
#: ValidationError (a DecodeError)
_decode = msgspec.json.Decoder(_Answer).decode


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    #: ``prompt_tokens_details.cached_tokens`` (None when the engine does not report it)
    cached_tokens: int | None = None


def _usage_of(answer: _Answer) -> Usage | None:
    usage = answer.usage
    if usage is None and isinstance(answer.response, dict):  # Responses API events
        usage = answer.response.get("usage")
    return usage_from(usage)


def usage_from(usage: Any) -> Usage | None:
    """A decoded ``usage`` object as :class:`Usage` (None: not one)."""
    if not isinstance(usage, dict):
        return None
    prompt = usage.get("prompt_tokens", usage.get("input_tokens"))
    completion = usage.get("completion_tokens", usage.get("output_tokens", 0))
    if not isinstance(prompt, int) or not isinstance(completion, int):
        return None
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return Usage(prompt, completion, cached if isinstance(cached, int) else None)


def usage_of_json(body: bytes) -> Usage | None:
    """The usage of a complete JSON answer (None: none, or not JSON)."""
    try:
        return _usage_of(_decode(body))
    except msgspec.DecodeError:
        return None


class UsageReader:
    """Fed every chunk of one answer; :meth:`usage` at its end."""

    __slots__ = ("_chunks", "_size", "event_stream")

    def __init__(self, event_stream: bool) -> None:
        self.event_stream = event_stream
        self._chunks: list[bytes] = []
        self._size = 0

    def feed(self, chunk: bytes) -> None:
        if not chunk or (not self.event_stream and self._size > JSON_LIMIT):
            return
        self._chunks.append(chunk)
        self._size += len(chunk)
        if self.event_stream:
            while self._size - len(self._chunks[0]) >= SSE_TAIL:
                self._size -= len(self._chunks.pop(0))
        elif self._size > JSON_LIMIT:
            self._chunks.clear()  # too large to parse: stop keeping it
            self._size = JSON_LIMIT + 1

    def body(self) -> bytes:
        """What was kept: a JSON answer's whole body (empty past the limit), or a
        stream's tail."""
        return b"".join(self._chunks)

    def usage(self) -> Usage | None:
        """The answer's usage (None when it has none, or is not readable)."""
        if not self._chunks:
            return None
        data = b"".join(self._chunks)
        if not self.event_stream:
            return usage_of_json(data)
        for line in reversed(data.split(b"\n")):
            line = line.strip()
            if not line.startswith(b"data:") or b'"usage"' not in line:
                continue
            try:
                found = _usage_of(_decode(line[5:].strip()))
            except msgspec.DecodeError:
                continue
            if found is not None:
                return found
        return None
