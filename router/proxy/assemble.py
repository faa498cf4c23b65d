"""A JSON answer assembled from the pod's stream (``proxy.stream_json_answers``).

vLLM sends a JSON answer whole after its last token, so a router that forwards such a
request as it came never sees its first token: the prompt stays outstanding prefill in
the router's load until the answer ends, no TTFT is timed, the policy hears no
``on_first_token`` (a learning policy keeps its priors), and a pod that hangs before
its first token cannot be failed over by ``proxy.first_byte_timeout_s``.  Dynamo's
router sees every first token because its frontend always streams from the engine;
kvroute does the same for the requests it can assemble exactly:

A Responses request's answer is its stream's final response, taken whole
(:mod:`.responses_answer`); the rest of this module is for chat and text completions.

* :func:`assemblable` — a chat or text completion that asked for no stream, one choice
  (``n`` absent or 1) and nothing whose streamed form differs from the JSON one
  (``logprobs``, ``top_logprobs``, ``prompt_logprobs``, ``echo``, ``best_of``,
  ``return_token_ids``, ``return_tokens_as_token_ids``, ``kv_transfer_params``), and
  more than one token (:func:`one_token`: an answer of at most one token comes right
  after its first token, so its head is its first token: it goes as it came, and the
  router counts its head as its first token, deadline included);
* :func:`streamed_body` — the bytes sent on: the client's body with ``"stream": true``
  and ``"stream_options": {"include_usage": true}`` (the JSON answer carries usage);
* :class:`Assembler` — fed the SSE bytes as they come, then :meth:`Assembler.answer`
  builds the JSON answer: the first chunk's ``id``, ``created``, ``model`` (and any other
  top-level field), ``object`` ``chat.completion`` / ``text_completion``, per choice the
  concatenated ``content`` / ``text`` (and any other text field of the delta, such as
  ``reasoning_content``), the tool calls merged by index (their ``arguments``
  concatenated; no ``tool_calls`` key without one, as vLLM answers), the last non-null
  value of every other choice field (``finish_reason``, ``stop_reason``) and of every
  other top-level field (the usage event's ``usage`` and ``system_fingerprint``).

A stream that is not the SSE of a completion (an event that is not a JSON object, no
chunk at all) raises :class:`StreamUnreadable`; an ``error`` event raises
:class:`StreamFailed` with its message.  The client then gets an OpenAI error (502),
never a half answer: nothing reached it before the answer was whole.
"""

from __future__ import annotations

from typing import Any

import msgspec

from router.decision.request import Routed
from router.errors import RouterError
from router.logs import RateLimitedLog
from router.metrics import RouterMetrics
from router.proxy.sse import EventFeed, data_of
from router.rewrite import rewrite_body

#: request fields whose streamed answer differs from the JSON one (not assembled)
_NOT_ASSEMBLED = (
    "logprobs",
    "top_logprobs",
    "prompt_logprobs",
    "echo",
    "best_of",
    "return_token_ids",
    "return_tokens_as_token_ids",
    "kv_transfer_params",
)
_OBJECT = {"chat": "chat.completion", "completion": "text_completion"}
_LEAD = ("id", "object", "created", "model")
_STREAM_SETS = {"stream": True, "stream_options": {"include_usage": True}}
_RESPONSES_STREAM_SETS = {"stream": True}
_decode = msgspec.json.Decoder()
_encode = msgspec.json.Encoder()


class StreamUnreadable(ValueError):
    """The pod's stream is not the SSE of a completion."""


class StreamFailed(Exception):
    """The pod's stream ended with an ``error`` event (its message)."""


def unassembled(
    pod: str, exc: Exception, metrics: RouterMetrics, log: RateLimitedLog
) -> RouterError:
    """The 502 a client gets for a JSON answer whose stream ``pod`` sent could not be
    assembled (``exc``: :class:`StreamUnreadable` or :class:`StreamFailed`), in either
    front: counted in ``kvroute_upstream_errors_total`` by its reason (``stream_error`` /
    ``stream_unreadable``) and logged on ``log``."""
    reason = "stream_error" if isinstance(exc, StreamFailed) else "stream_unreadable"
    metrics.child(metrics.upstream_errors, pod, reason).inc()
    log.warning((reason, pod), "pod %s: the stream of a JSON answer: %s", pod, exc)
    return RouterError(502, f"pod {pod} answered no whole completion: {exc}", reason=reason)


def one_token(routed: Routed) -> bool:
    """Whether ``routed`` is a chat or text completion asking for a JSON answer of at
    most one token (``max_tokens`` / ``max_completion_tokens`` <= 1): vLLM sends it
    right after that token, so its head is its first token."""
    if routed.kind not in _OBJECT or routed.stream:
        return False
    body = routed.body
    limit = body.get("max_completion_tokens") if routed.kind == "chat" else None
    if limit is None:
        limit = body.get("max_tokens")
    return isinstance(limit, int) and not isinstance(limit, bool) and limit <= 1


def assemblable(routed: Routed) -> bool:
    """Whether ``routed``'s JSON answer can be assembled exactly from a stream, and is
    worth it (not :func:`one_token`: its head already tells its first token).  A
    Responses request is, unless it runs in the background (its answer is a queued
    response, not the result): :mod:`.responses_answer`."""
    body = routed.body
    if routed.stream or routed.pd is not None:
        return False
    if routed.kind == "responses":
        return not body.get("background")
    if routed.kind not in _OBJECT:
        return False
    if one_token(routed):
        return False
    n = body.get("n")
    if n is not None and n != 1:
        return False
    for key in _NOT_ASSEMBLED:
        value = body.get(key)
        if value is not None and value is not False:
            return False
    return True


def streamed_body(raw: bytes, body: dict[str, Any], kind: str = "chat") -> bytes:
    """``raw`` (the bytes the client's ``body`` was parsed from) asking for a stream
    with its usage (a Responses stream's final event carries it); ``body`` is left as
    the client sent it."""
    sets = _RESPONSES_STREAM_SETS if kind == "responses" else _STREAM_SETS
    return rewrite_body(raw, body, set_fields=sets)


class Assembler(EventFeed):
    """The SSE of one completion, read as it comes; :meth:`answer` is the JSON."""

    __slots__ = ("_choices", "_chunks", "_kind", "_top")

    def __init__(self, kind: str) -> None:
        super().__init__()
        self._kind = kind
        self._chunks = 0
        #: the top-level fields, the last non-null value of each (vLLM sends
        #: ``system_fingerprint`` with the usage, after the first chunk)
        self._top: dict[str, Any] = {}
        self._choices: dict[int, dict[str, Any]] = {}

    def answer(self) -> bytes:
        """The JSON answer (raises :class:`StreamUnreadable` / :class:`StreamFailed`)."""
        self._flush()
        if not self._chunks:
            raise StreamUnreadable("the stream carried no completion chunk")
        top = self._top
        out = {k: top[k] for k in _LEAD if k in top}  # (in OpenAI's order, for a reader)
        out["object"] = _OBJECT[self._kind]
        out["choices"] = [self._finish(c) for _, c in sorted(self._choices.items())]
        out["usage"] = top.get("usage")
        out.update((k, v) for k, v in top.items() if k not in out)
        return _encode.encode(out)

    def _event(self, event: bytes) -> None:
        data = data_of(event)
        if not data or data == b"[DONE]":
            return
        try:
            chunk = _decode.decode(data)
        except msgspec.DecodeError:
            raise StreamUnreadable(f"an event is not JSON: {data[:80]!r}") from None
        if not isinstance(chunk, dict):
            raise StreamUnreadable(f"an event is not a JSON object: {data[:80]!r}")
        error = chunk.get("error")
        if error is not None:
            message = error.get("message") if isinstance(error, dict) else error
            raise StreamFailed(str(message))
        self._chunks += 1
        top = self._top
        for key, value in chunk.items():
            if key != "choices" and (value is not None or key not in top):
                top[key] = value
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            raise StreamUnreadable("a chunk has no choices list")
        for choice in choices:
            if not isinstance(choice, dict):
                raise StreamUnreadable("a choice is not an object")
            self._merge(choice)

    def _merge(self, choice: dict[str, Any]) -> None:
        index = choice.get("index", 0)
        if not isinstance(index, int):
            raise StreamUnreadable("a choice's index is not an integer")
        into = self._choices.setdefault(index, {"index": index, "_text": {}, "_tools": {}})
        for key, value in choice.items():
            if key == "delta" and isinstance(value, dict):
                self._merge_delta(into, value)
            elif key == "text" and isinstance(value, str):
                into["_text"]["text"] = into["_text"].get("text", "") + value
            elif key != "index" and (value is not None or key not in into):
                into[key] = value

    @staticmethod
    def _merge_delta(into: dict[str, Any], delta: dict[str, Any]) -> None:
        text, tools = into["_text"], into["_tools"]
        for key, value in delta.items():
            if key == "tool_calls" and isinstance(value, list):
                for call in value:
                    if isinstance(call, dict):
                        _merge_tool_call(tools, call)
            elif key == "role" and isinstance(value, str):
                into["_role"] = value
            elif isinstance(value, str):
                text[key] = text.get(key, "") + value
            elif key not in text:
                text[key] = value  # (a null field: kept as null unless text follows)

    def _finish(self, c: dict[str, Any]) -> dict[str, Any]:
        text, tools = c.pop("_text"), c.pop("_tools")
        role = c.pop("_role", "assistant")
        c.pop("delta", None)
        if self._kind != "chat":
            c["text"] = text.get("text", "")
            return c
        message: dict[str, Any] = {"role": role, "content": text.pop("content", None)}
        message.update(text)
        if tools:
            message["tool_calls"] = [tools[i] for i in sorted(tools)]
        c["message"] = message
        return {"index": c.pop("index"), "message": c.pop("message"), **c}


def _merge_tool_call(tools: dict[int, dict[str, Any]], call: dict[str, Any]) -> None:
    index = call.get("index", len(tools))
    if not isinstance(index, int):
        raise StreamUnreadable("a tool call's index is not an integer")
    into = tools.setdefault(index, {"id": None, "type": "function", "function": {}})
    for key, value in call.items():
        if key == "function" and isinstance(value, dict):
            fn = into["function"]
            for fk, fv in value.items():
                if isinstance(fv, str):
                    fn[fk] = fn.get(fk, "") + fv if fk == "arguments" else fv
                elif fv is not None:
                    fn[fk] = fv
        elif key != "index" and value is not None:
            into[key] = value
