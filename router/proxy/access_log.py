"""The access log of `kvroute serve`: one line per generation request, written when its
response has ended (a stream at its last byte, or when it was cut).

Off by default (``proxy.access_log: off``); ``on`` logs ``proxy.access_log_sample`` of
the requests (0..1, drawn per request; 1 = all), as ``text`` or ``json`` lines on
standard output (logger ``kvroute.access``, not propagated: the lines are the
whole message).  A text line::

    2025-06-01T10:00:00.123Z POST /v1/chat/completions status=200 model=Qwen/Qwen3-0.6B
    pod=vllm-0 prompt_tokens=1520 cached_tokens=1504 ttft_ms=88.1 latency_ms=412.3

(one line; fields that do not apply are left out; ``json`` has every field, ``null``
when it does not apply):

``ts``
    when the response ended (UTC, ISO 8601, milliseconds).
``method``, ``path``
    the request's (the path without its query).
``status``
    the status sent to the client (``499``: the client went away before the answer).
``reason``
    for an error the router answered itself, its OpenAI ``error.code`` (``no_healthy_pod``,
    ``connect``, ``first_byte_timeout``, ``invalid_messages``...).
``model``, ``pod``
    the request's model and the pod that answered (after a retry: the retry's pod).
``prompt_tokens``, ``cached_tokens``
    the prompt's tokens as the router tokenized them, and how many of them the index
    said the pod held (its prediction; the pod's own count is in
    ``kvroute_engine_cached_tokens_total``).  Absent for embeddings and passthrough paths.
``ttft_ms``
    for a stream, arrival to the first body byte sent (the router's TTFT, as in
    ``kvroute_ttft_seconds``); absent for a non-streaming answer (its first byte is
    the whole answer).
``latency_ms``
    arrival to the last byte sent.
``end``
    ``cut`` when the response stopped before its end (the client went away mid-stream),
    ``broken`` when the pod's stream broke; absent for a response sent whole.

Never logged: the prompt, the messages, any header, the answer's text.  The model name
is the one the request was routed on, i.e. a model the fleet serves.

The lines are written by the ASGI layer (:mod:`router.proxy.app` wraps the fast path's
``send`` for a sampled request), so the status, the first byte and the end are the ones
the client saw, and requests refused before any pod was chosen are logged too.  An
unsampled request costs one random draw.
"""

from __future__ import annotations

import logging
import random
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import msgspec
from starlette.types import Message, Scope, Send

from router.decision.request import Routed
from router.proxy.relay import UpstreamBroken

#: the logger the lines go to (its own stdout handler, not propagated)
LOGGER = "kvroute.access"

#: kinds routed without a prompt to tokenize (as in router.proxy.forward)
_NO_PROMPT_KINDS = frozenset({"embedding", "passthrough"})

_encode = msgspec.json.Encoder().encode
_decode_error = msgspec.json.Decoder(dict[str, Any]).decode

#: the field order of a line
FIELDS = (
    "ts",
    "method",
    "path",
    "status",
    "reason",
    "model",
    "pod",
    "prompt_tokens",
    "cached_tokens",
    "ttft_ms",
    "latency_ms",
    "end",
)


def _logger() -> logging.Logger:
    logger = logging.getLogger(LOGGER)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    # once per process (uvicorn workers are processes too)
    if not any(getattr(h, "kvroute_access", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.kvroute_access = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    return logger


class AccessLog:
    """The access-log settings of one app, and the writer of its lines."""

    def __init__(
        self,
        enabled: bool,
        sample: float = 1.0,
        fmt: str = "text",
        *,
        pod_header: str = "x-kvroute-pod",
        draw: Callable[[], float] = random.random,
    ) -> None:
        self.enabled = enabled and sample > 0
        self.sample = sample
        self.json = fmt == "json"
        self.pod_header = pod_header.lower().encode("latin-1")
        self._draw = draw
        self._log = _logger() if self.enabled else None

    def begin(self, scope: Scope, started: float) -> Entry | None:
        """An entry for this request when it is logged (on, and drawn), else None."""
        if not self.enabled or (self.sample < 1.0 and self._draw() >= self.sample):
            return None
        return Entry(self, scope, started)

    def write(self, fields: dict[str, Any]) -> None:
        if self._log is not None:
            self._log.info(format_line(fields, as_json=self.json))


class Entry:
    """One logged request: ``send`` (the wrapped ASGI send) watches its response; the
    app hands it the decided request (:attr:`routed`) and any error it answered
    itself, and :meth:`end` writes the line."""

    __slots__ = (
        "_send",
        "access",
        "complete",
        "first_at",
        "method",
        "path",
        "pod",
        "reason",
        "routed",
        "started",
        "status",
        "streamed",
    )

    def __init__(self, access: AccessLog, scope: Scope, started: float) -> None:
        self.access = access
        self.method: str = scope.get("method", "-")
        self.path: str = scope.get("path", "-")
        self.started = started
        self.routed: Routed | None = None
        self.reason: str | None = None
        self.status: int | None = None
        self.pod: str | None = None
        self.first_at: float | None = None
        self.streamed = False
        self.complete = False
        self._send: Send | None = None

    def watch(self, send: Send) -> Send:
        """``send``, watched: the status, the answering pod, the first body byte and
        the last."""
        self._send = send
        return self._watched

    async def _watched(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.start":
            self.status = message["status"]
            for name, value in message.get("headers", ()):
                if name.lower() == self.access.pod_header:
                    self.pod = value.decode("latin-1")
        elif kind == "http.response.body":
            body = message.get("body", b"")
            more = message.get("more_body", False)
            if more:
                self.streamed = True
            if body and self.first_at is None:
                self.first_at = time.perf_counter()
            if not more:
                self.complete = True
            if self.reason is None and self.status is not None and self.status >= 400 and body:
                self.reason = _error_code(body)
        assert self._send is not None
        await self._send(message)

    def end(self, error: BaseException | None = None) -> None:
        """The response has ended (``error``: what stopped it): write the line."""
        now = time.perf_counter()
        routed = self.routed
        fields: dict[str, Any] = dict.fromkeys(FIELDS)
        fields["ts"] = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        fields["method"] = self.method
        fields["path"] = self.path
        fields["status"] = self.status if self.status is not None else 500
        fields["reason"] = self.reason
        fields["pod"] = self.pod
        if routed is not None:
            fields["model"] = routed.model
            pod = self.pod
            if routed.kind not in _NO_PROMPT_KINDS:
                fields["prompt_tokens"] = routed.route.prompt_tokens
                if pod is not None and pod in routed.views:
                    fields["cached_tokens"] = routed.cached_tokens(pod)
        if self.streamed and self.first_at is not None:
            fields["ttft_ms"] = round((self.first_at - self.started) * 1000, 1)
        fields["latency_ms"] = round((now - self.started) * 1000, 1)
        if isinstance(error, UpstreamBroken):
            fields["end"] = "broken"
        elif (error is not None or not self.complete) and self.status is not None:
            fields["end"] = "cut"
        self.access.write(fields)


def _error_code(body: bytes) -> str | None:
    """The ``error.code`` of an OpenAI error body, when it is a string."""
    try:
        error = _decode_error(body).get("error")
    except msgspec.DecodeError:
        return None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None


def format_line(fields: dict[str, Any], *, as_json: bool) -> str:
    """One access-log line: a JSON object, or ``ts method path key=value...`` (values
    quoted when they hold a space, a quote or an ``=``; ``None`` left out)."""
    if as_json:
        return _encode(fields).decode()
    parts = [str(fields["ts"]), str(fields["method"]), _value(fields["path"])]
    for key in FIELDS[3:]:
        value = fields.get(key)
        if value is not None:
            parts.append(f"{key}={_value(value)}")
    return " ".join(parts)


def _value(value: Any) -> str:
    text = str(value)
    if not text or any(c in text for c in ' "=\\') or not text.isprintable():
        return _encode(text).decode()
    return text
