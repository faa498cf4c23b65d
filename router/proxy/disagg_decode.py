"""The decode half of a split request (steps 3 to 5 of :mod:`router.proxy.disagg`):
:class:`DecodeLeg` chooses each decode attempt's body for
:meth:`router.proxy.forward.Proxy.forward` (the prefill pod's ``kv_transfer_params``
while no decode pod could have used them, within ``pd.kv_lease_s`` of the prefill
answer; the plain body otherwise), makes a 500 before any byte retryable, puts the
prefill's cached tokens in the usage of a transfer's answer (its JSON, or its stream's
usage event, the stream relayed line by line) and names the prefill pod in a header.
:class:`Prefilled` is what the prefill half hands it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgspec

from router.decision.disagg import PDSettings
from router.decision.request import Routed
from router.errors import RouterError
from router.proxy.forward import RETRYABLE_STATUS, Proxy
from router.rewrite import rewrite_body

#: a decode attempt answering one of these before any byte went out is retried
DECODE_RETRYABLE = RETRYABLE_STATUS | {500}

_decode = msgspec.json.decode
_encode = msgspec.json.encode
_monotonic = time.monotonic


@dataclass(slots=True)
class Prefilled:
    """A prefill pod's answer with params."""

    pod: str
    params: dict[str, Any]
    cached_tokens: int | None
    at: float


class DecodeLeg:
    """The decode half's attempts, for :meth:`Proxy.forward` (see the module docstring
    and :mod:`router.proxy.disagg`'s)."""

    retry_status = DECODE_RETRYABLE

    def __init__(
        self,
        routed: Routed,
        raw: bytes,
        prefilled: Prefilled,
        settings: PDSettings,
        proxy: Proxy,
    ) -> None:
        self.routed = routed
        self.plain = raw
        self.with_params = rewrite_body(
            raw, routed.body, set_fields={"kv_transfer_params": prefilled.params}
        )
        self.prefilled = prefilled
        self.deadline = prefilled.at + settings.kv_lease_s
        self.metrics = proxy.metrics
        name = settings.prefill_pod_header
        self.headers = [(name.encode("latin-1"), prefilled.pod.encode("latin-1"))]
        self.header_map = {name: prefilled.pod}
        #: the current attempt carries the params (its answer's usage is merged)
        self.transfer = False
        self.attempts = 0
        route = routed.route
        self._tail_tokens = max(1, route.prompt_tokens % route.block_size)
        #: where the answer's usage keeps its cached tokens (the Responses API's name)
        responses = routed.kind == "responses"
        self.details = "input_tokens_details" if responses else "prompt_tokens_details"

    @property
    def count_usage(self) -> bool:
        """Count the answer's cached tokens against the decode pod's prediction: only a
        plain attempt's (a transfer's include the pulled blocks)."""
        return not self.transfer

    def attempt(self, pod: str, last_error: RouterError | None) -> tuple[bytes, int]:
        """The body and load tokens of the next decode attempt, on ``pod``."""
        m, model = self.metrics, self.routed.model
        self.attempts += 1
        unused = last_error is None or last_error.reason == "connect"
        if unused and _monotonic() < self.deadline:
            self.transfer = True
            m.child(m.pd_transfers, model, "first" if self.attempts == 1 else "retry").inc()
            return self.with_params, self._tail_tokens
        if self.transfer or self.attempts == 1:  # the params are spent: plain from now on
            m.child(m.pd_fallbacks, model, "decode_retry").inc()
        self.transfer = False
        return self.plain, self.routed.route.prompt_tokens

    def edit_body(self, status: int, content: bytes) -> bytes:
        """A JSON answer with the prefill's cached tokens in its usage."""
        cached = self.prefilled.cached_tokens
        if not self.transfer or cached is None or not 200 <= status < 300:
            return content
        if f'"{self.details}"'.encode() not in content:
            return content
        try:
            obj = _decode(content)
        except msgspec.DecodeError:
            return content
        return _encode(obj) if _set_cached(obj, cached, self.details) else content

    def wrap(self, status: int, stream: AsyncIterable[bytes]) -> AsyncIterable[bytes]:
        """A stream whose usage event carries the prefill's cached tokens (when the
        request asked for one; a response stream's ``response.completed`` always has
        it); any other stream as it is."""
        options = self.routed.body.get("stream_options")
        wants = isinstance(options, dict) and options.get("include_usage") is True
        wants = wants or self.routed.kind == "responses"
        cached = self.prefilled.cached_tokens
        if not (wants and self.transfer and cached is not None and 200 <= status < 300):
            return stream
        return _merge_stream(stream, cached, self.details)


def _set_cached(obj: Any, cached: int, key: str = "prompt_tokens_details") -> bool:
    """Set ``cached_tokens`` in ``obj``'s usage (``obj["usage"]``, or a response event's
    ``obj["response"]["usage"]``) under ``key``; whether it could."""
    if not isinstance(obj, dict):
        return False
    usage = obj.get("usage")
    if usage is None and isinstance(obj.get("response"), dict):
        usage = obj["response"].get("usage")
    details = usage.get(key) if isinstance(usage, dict) else None
    if not isinstance(details, dict):
        return False
    details["cached_tokens"] = cached
    return True


async def _merge_stream(
    stream: AsyncIterable[bytes], cached: int, key: str = "prompt_tokens_details"
) -> AsyncIterator[bytes]:
    """Relay complete lines; the ``data:`` line with the usage re-encoded."""
    marker = f'"{key}"'.encode()
    pending = b""
    async for chunk in stream:
        data = pending + chunk if pending else chunk
        cut = data.rfind(b"\n")
        if cut < 0:
            pending = data
            continue
        done, pending = data[: cut + 1], data[cut + 1 :]
        if marker in done:
            done = _merge_lines(done, cached, key)
        yield done
    if pending:
        yield pending


def _merge_lines(data: bytes, cached: int, key: str) -> bytes:
    marker = f'"{key}"'.encode()
    lines = data.split(b"\n")
    for i, line in enumerate(lines):
        if not line.startswith(b"data:") or marker not in line:
            continue
        try:
            obj = _decode(line[5:].strip())
        except msgspec.DecodeError:
            continue
        if _set_cached(obj, cached, key):
            end = b"\r" if line.endswith(b"\r") else b""
            lines[i] = b"data: " + _encode(obj) + end
    return b"\n".join(lines)
