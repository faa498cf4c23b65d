"""The usage the router asks a pod for and the client did not (tenants' token limits).

A stream's completion tokens are known only from the pod's usage event, which vLLM sends
only when the request asked ``stream_options.include_usage``.  So with tenants, both
fronts (`kvroute serve`, :mod:`router.proxy.answers`; `kvroute epp`,
:mod:`router.epp.stream`) ask for it on every chat or completion stream whose client did
not (:func:`usage_options`, applied by :class:`router.tenants.gate.TenantGate` through
:func:`router.rewrite.rewrite_body`), and :class:`HiddenUsage` takes the usage event
back out of what the client receives, so that the client's stream is the one it would
have had without the router's question:

* the usage-only event (``"choices": []`` with a ``usage``) is read and dropped;
* vLLM (0.32, ``chat_completion/serving.py``, ``completion/serving.py``) stamps the
  ``system_fingerprint`` on the terminal chunks (a ``finish_reason`` set) when no usage
  event follows, and on the usage event instead when one does.  So from the first
  terminal chunk on, events are held until the usage event arrives, and each held
  terminal chunk that has no fingerprint gets the usage event's, spliced in as the
  last member (where vLLM serialises it: after ``choices``, the other later members
  unset).  With one choice (``n`` = 1, nearly every request) nothing is held but the
  terminal chunk, for the time the engine takes to send the usage event right after;
  with ``n`` > 1 the events after the first finished choice wait for the last one;
* a stream without a usage event (a pod that ignores the option, an error) is relayed
  as it came, the held events at its end.

Events are relayed as they came, byte for byte; only their split into chunks follows
the event boundaries (a blank line: ``\\n\\n`` as vLLM and the sim send it, or with
``\\r\\n`` line ends) instead of the pod's writes.  Not hidden: a pod started with
``--enable-force-include-usage`` sends usage on every chunk to every client anyway; the
router cannot tell it from its own question, and the client gets what that pod sends to
everyone, minus the final usage event.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterable, AsyncIterator, Mapping
from typing import Any

import msgspec

from router.usage import Usage, usage_from

#: the request kinds whose streams end with a usage event when asked
KINDS = frozenset({"chat", "completion"})

#: the end of an event: a blank line, in any of the line ends SSE allows
_SEP = re.compile(rb"\r\n\r\n|\n\n|\r\r")
_TERMINAL = b'"finish_reason":"'
_NO_CHOICES = b'"choices":[]'
_USAGE = b'"usage":'
_FINGERPRINT = b'"system_fingerprint"'


class _UsageEvent(msgspec.Struct):
    usage: Any = None
    system_fingerprint: Any = None


_decode_event = msgspec.json.Decoder(_UsageEvent).decode
_encode = msgspec.json.encode


def asks_for_usage(kind: str, body: Mapping[str, Any]) -> bool:
    """Whether the router adds ``include_usage`` to this request: a chat or completion
    stream whose client did not ask for usage itself (``stream_options`` absent, or an
    object without ``include_usage: true``)."""
    if kind not in KINDS or body.get("stream") is not True:
        return False
    options = body.get("stream_options")
    if options is None:
        return True
    return isinstance(options, dict) and options.get("include_usage") is not True


def usage_options(body: Mapping[str, Any]) -> dict[str, Any]:
    """The ``stream_options`` sent on: the client's, with ``include_usage`` on (and
    ``continuous_usage_stats`` off when the client set it: vLLM ignores it without
    ``include_usage``, so the client's stream had no per-chunk usage)."""
    options = body.get("stream_options")
    out = dict(options) if isinstance(options, dict) else {}
    out["include_usage"] = True
    if "continuous_usage_stats" in out:
        out["continuous_usage_stats"] = False
    return out


def _data(event: bytes) -> bytes | None:
    """The JSON of a ``data:`` event (None: another kind of event, or ``[DONE]``)."""
    line = event.strip()
    if not line.startswith(b"data:"):
        return None
    payload = line[5:].strip()
    return payload if payload.startswith(b"{") else None


class HiddenUsage:
    """Relays one stream without the usage event the router asked for; :attr:`usage`
    holds that event's usage once it passed."""

    __slots__ = ("_held", "_rest", "usage")

    def __init__(self) -> None:
        self.usage: Usage | None = None
        self._rest = b""
        #: events from the first terminal chunk on, waiting for the usage event
        self._held: list[bytes] | None = None

    async def relay(self, source: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
        """``source``'s events, the usage event removed (see the module docstring)."""
        async for chunk in source:
            out = self.feed(chunk)
            if out:
                yield out
        tail = self.flush()
        if tail:
            yield tail

    def feed(self, chunk: bytes) -> bytes:
        """The bytes to send on after ``chunk`` (complete events only)."""
        data = self._rest + chunk if self._rest else chunk
        out: list[bytes] = []
        start = 0
        for sep in _SEP.finditer(data):
            self._event(data[start : sep.end()], out)
            start = sep.end()
        self._rest = data[start:]
        return b"".join(out)

    def flush(self) -> bytes:
        """The stream ended: whatever is still held, as it came."""
        held, self._held = self._held or [], None
        rest, self._rest = self._rest, b""
        return b"".join(held) + rest

    def _event(self, event: bytes, out: list[bytes]) -> None:
        if self.usage is None and _NO_CHOICES in event and _USAGE in event:
            payload = _data(event)
            if payload is not None:
                try:
                    parsed = _decode_event(payload)
                except msgspec.DecodeError:
                    parsed = _UsageEvent()
                usage = usage_from(parsed.usage)
                if usage is not None:
                    self.usage = usage
                    self._release(parsed.system_fingerprint, out)
                    return
        if self._held is not None:
            self._held.append(event)
        elif self.usage is None and _TERMINAL in event:
            self._held = [event]
        else:
            out.append(event)

    def _release(self, fingerprint: Any, out: list[bytes]) -> None:
        held, self._held = self._held or [], None
        stamp = b"," + _FINGERPRINT + b":" + _encode(fingerprint) if fingerprint else b""
        for event in held:
            if stamp and _TERMINAL in event and _FINGERPRINT not in event:
                event = _stamp(event, stamp)
            out.append(event)


def _stamp(event: bytes, member: bytes) -> bytes:
    """``event`` (``data: {...}`` and its separator) with ``member`` added last."""
    body = event.rstrip()
    if not body.endswith(b"}"):
        return event
    return body[:-1] + member + b"}" + event[len(body) :]
