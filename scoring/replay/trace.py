"""Trace loaders: Mooncake JSONL and OpenAI request-body JSONL -> :class:`TraceRequest`\\ s.

Mooncake (``--format mooncake``): one object a line, ``timestamp`` (ms from start),
``input_length``, ``output_length`` (tokens) and ``hash_ids``: ids of 512-token blocks,
where two requests sharing their first k ids share their first k*512 tokens.  Block key
``i`` is ``xxh3_64(key[i-1] || hash_ids[i])`` chained from a fixed root, so a key names a
whole prefix as our token block keys do.  The last block may be partial
(``input_length - 512*(n-1)`` tokens): hit tokens are counted as
``min(matched_blocks * 512, input_length)``.

OpenAI (``--format openai``): one object a line, either a request body (``messages`` for
chat, ``prompt`` for completions) or ``{"timestamp": ms, "body": {...}}``; optional
top-level ``timestamp`` (ms), ``session_id`` (else the body's ``user``), and
``output_length`` (else the body's ``max_completion_tokens`` / ``max_tokens``, else the
default).  Lines without a timestamp arrive ``1 / arrival_rate`` s after the previous one.
With a tokenizer the prompt is rendered and tokenized exactly (via
:func:`router.tokenize.load_tokenizer`) and hashed with :class:`scoring.blocks.BlockHasher`.
Without one, a *character estimate* is used and flagged (``Trace.approximate``): the
rendered text counts ``ceil(chars / 4)`` tokens and each ``4 * block_size``-character
chunk is one block.

A malformed line is recorded with its line number in ``Trace.errors``, counted and
skipped; it never stops the load.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from scoring.blocks import BlockHasher, root_key
from scoring.policies.base import RouteRequest

_h64 = xxhash.xxh3_64_intdigest
_pack = struct.Struct("<QQ").pack

MOONCAKE_BLOCK_TOKENS = 512
CHARS_PER_TOKEN = 4


class TraceFormatError(ValueError):
    """A trace line cannot be used; the message says what is wrong."""


@dataclass(slots=True)
class TraceRequest:
    """One request of a trace, ready to route."""

    arrival_s: float
    output_tokens: int
    route: RouteRequest
    turns: int | None = None  # user turns in the conversation, when known
    #: keys of the blocks past the prompt's full ones that its answer fills, when a later
    #: prompt of the trace carries the answer (a chat's or an agent's next turn): the
    #: engine caches them as it decodes, so that prompt hits them on the same pod.
    #: Empty: the answer's blocks are the request's own (no later prompt has them)
    answer_keys: Sequence[int] = ()

    @property
    def prompt_tokens(self) -> int:
        return self.route.prompt_tokens

    def cached_keys(self) -> list[int]:
        """The keys a pod's cache holds once this request ran: its prompt's full blocks,
        then its answer's (``answer_keys``)."""
        keys = list(self.route.block_keys)
        if self.answer_keys:
            del keys[self.prompt_tokens // self.route.block_size :]
            keys.extend(self.answer_keys)
        return keys


@dataclass
class Trace:
    """Requests sorted by arrival, plus what could not be read."""

    requests: list[TraceRequest]
    block_size: int
    fmt: str
    approximate: bool = False
    errors: list[tuple[int, str]] = field(default_factory=list)
    lines: int = 0

    @property
    def malformed(self) -> int:
        return len(self.errors)


def mooncake_keys(hash_ids: Sequence[int], root: int) -> list[int]:
    """Chain Mooncake block ids into prefix keys: ``key_i = xxh3(key_{i-1}, id_i)``."""
    out: list[int] = []
    k = root
    for h in hash_ids:
        k = _h64(_pack(k, h))
        out.append(k)
    return out


def _number(obj: Mapping[str, Any], name: str, *, integer: bool, minimum: float) -> float:
    if name not in obj:
        raise TraceFormatError(f"missing field {name!r}")
    v = obj[name]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise TraceFormatError(f"field {name!r} must be a number, got {type(v).__name__}")
    if integer and not float(v).is_integer():
        raise TraceFormatError(f"field {name!r} must be an integer, got {v!r}")
    if not math.isfinite(v) or v < minimum:
        raise TraceFormatError(f"field {name!r} must be >= {minimum}, got {v!r}")
    return float(v)


def _mooncake_request(obj: Any, idx: int, root: int) -> TraceRequest:
    if not isinstance(obj, dict):
        raise TraceFormatError(f"expected a JSON object, got {type(obj).__name__}")
    ts = _number(obj, "timestamp", integer=False, minimum=0)
    prompt = int(_number(obj, "input_length", integer=True, minimum=1))
    output = int(_number(obj, "output_length", integer=True, minimum=0))
    ids = obj.get("hash_ids")
    if not isinstance(ids, list) or not ids:
        raise TraceFormatError("field 'hash_ids' must be a non-empty list of block ids")
    if not all(isinstance(h, int) and not isinstance(h, bool) and 0 <= h < 2**64 for h in ids):
        raise TraceFormatError("field 'hash_ids' must hold integers in [0, 2**64)")
    needed = math.ceil(prompt / MOONCAKE_BLOCK_TOKENS)
    if len(ids) > needed:
        raise TraceFormatError(
            f"'hash_ids' has {len(ids)} blocks but input_length {prompt} fills only {needed}"
        )
    route = RouteRequest(
        request_id=f"r{idx}",
        model="mooncake",
        prompt_tokens=prompt,
        block_keys=mooncake_keys(ids, root),
        block_size=MOONCAKE_BLOCK_TOKENS,
        max_tokens=output,
    )
    return TraceRequest(arrival_s=ts / 1000.0, output_tokens=output, route=route)


def _lines(path: Path) -> Iterable[tuple[int, str]]:
    with path.open("r", encoding="utf-8", errors="replace") as fh:
        yield from enumerate(fh, 1)


def load_mooncake(path: Path) -> Trace:
    root = root_key("mooncake")
    trace = Trace(requests=[], block_size=MOONCAKE_BLOCK_TOKENS, fmt="mooncake")
    for lineno, line in _lines(path):
        trace.lines = lineno
        if not line.strip():
            continue
        try:
            trace.requests.append(_mooncake_request(json.loads(line), lineno, root))
        except (json.JSONDecodeError, TraceFormatError) as exc:
            trace.errors.append((lineno, str(exc)))
    trace.requests.sort(key=lambda r: r.arrival_s)  # stable: file order among equal times
    return trace


def _render_text(body: Mapping[str, Any]) -> str:
    """The ChatML-like text used by the character estimate."""
    if "prompt" in body:
        return str(body["prompt"])
    parts = []
    if body.get("tools"):
        parts.append("<|im_start|>tools\n" + json.dumps(body["tools"], sort_keys=True))
    for m in body["messages"]:
        content = m.get("content")
        if isinstance(content, list):
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        parts.append(f"<|im_start|>{m.get('role')}\n{content or ''}<|im_end|>\n")
    parts.append("<|im_start|>assistant\n")
    return "".join(parts)


def approx_keys(text: str, block_size: int, model: str) -> tuple[int, list[int]]:
    """Character estimate: ``ceil(len/4)`` tokens, one block per ``4*block_size`` chars."""
    data = text.encode("utf-8")
    step = CHARS_PER_TOKEN * block_size
    k = root_key(model)
    keys = []
    for off in range(0, (len(data) // step) * step, step):
        k = _h64(k.to_bytes(8, "little") + data[off : off + step])
        keys.append(k)
    return max(1, math.ceil(len(data) / CHARS_PER_TOKEN)), keys


def _openai_request(
    obj: Any,
    idx: int,
    prev_ts: float,
    *,
    block_size: int,
    tokenizer: Any,
    default_output: int,
    arrival_rate: float,
) -> TraceRequest:
    if not isinstance(obj, dict):
        raise TraceFormatError(f"expected a JSON object, got {type(obj).__name__}")
    body = obj.get("body", obj)
    if not isinstance(body, dict):
        raise TraceFormatError("field 'body' must be an object")
    messages = body.get("messages")
    if messages is None and not isinstance(body.get("prompt"), str):
        raise TraceFormatError("body needs 'messages' (chat) or a string 'prompt' (completions)")
    if messages is not None and (
        not isinstance(messages, list)
        or not messages
        or not all(isinstance(m, dict) and "role" in m for m in messages)
    ):
        raise TraceFormatError("'messages' must be a non-empty list of objects with a 'role'")
    if "timestamp" in obj:
        ts = _number(obj, "timestamp", integer=False, minimum=0) / 1000.0
    else:
        ts = prev_ts + 1.0 / arrival_rate
    if "output_length" in obj:
        output = int(_number(obj, "output_length", integer=True, minimum=0))
    elif "max_completion_tokens" in body:
        output = int(_number(body, "max_completion_tokens", integer=True, minimum=0))
    elif "max_tokens" in body:
        output = int(_number(body, "max_tokens", integer=True, minimum=0))
    else:
        output = default_output
    model = str(body.get("model", ""))
    salt = body.get("cache_salt")
    if tokenizer is not None:
        try:
            if messages is not None:
                ids = tokenizer.encode_chat(messages, tools=body.get("tools"))
            else:
                ids = tokenizer.encode_prompt(body["prompt"])
        except ValueError as exc:
            raise TraceFormatError(f"cannot tokenize: {exc}") from None
        keys = BlockHasher(block_size, model).keys(ids, cache_salt=salt)
        prompt = max(1, len(ids))
    else:
        prompt, keys = approx_keys(_render_text(body), block_size, model)
    session = obj.get("session_id", body.get("user"))
    turns = sum(1 for m in messages if m.get("role") == "user") if messages is not None else None
    route = RouteRequest(
        request_id=f"r{idx}",
        model=model,
        prompt_tokens=prompt,
        block_keys=keys,
        block_size=block_size,
        session=str(session) if session is not None else None,
        max_tokens=output,
    )
    return TraceRequest(arrival_s=ts, output_tokens=output, route=route, turns=turns)


def load_openai(
    path: Path,
    *,
    block_size: int,
    tokenizer: Any = None,
    default_output: int = 128,
    arrival_rate: float = 1.0,
    answers_in_history: bool = False,
) -> Trace:
    """An OpenAI-body trace (one request a line).  With ``answers_in_history`` (a capture
    of real traffic, whose histories carry the answers the pods generated) each turn's
    answer is linked to its session's next prompt (:func:`link_answers`); without it (a
    benchmark whose histories carry answers of its own) no answer is read back."""
    trace = Trace(requests=[], block_size=block_size, fmt="openai", approximate=tokenizer is None)
    prev = -1.0 / arrival_rate
    for lineno, line in _lines(path):
        trace.lines = lineno
        if not line.strip():
            continue
        try:
            req = _openai_request(
                json.loads(line),
                lineno,
                prev,
                block_size=block_size,
                tokenizer=tokenizer,
                default_output=default_output,
                arrival_rate=arrival_rate,
            )
        except (json.JSONDecodeError, TraceFormatError) as exc:
            trace.errors.append((lineno, str(exc)))
            continue
        prev = req.arrival_s
        trace.requests.append(req)
    trace.requests.sort(key=lambda r: r.arrival_s)
    if answers_in_history:
        link_answers(trace.requests)
    return trace


def link_answers(requests: Sequence[TraceRequest]) -> None:
    """Set ``answer_keys`` of each request (in arrival order) whose session's next
    prompt goes on from its prompt: that prompt holds the answer's tokens next (a chat
    history, an agent's context with its output appended), so the blocks it has in
    ``[prompt // B, (prompt + output - 1) // B)`` are the ones the engine cached while
    decoding (the last token is sampled, never computed).  A next prompt that starts
    over (an agent's compaction) or edits the history links nothing; requests without
    a session are left alone."""
    last: dict[str, TraceRequest] = {}
    for r in requests:
        session = r.route.session
        if session is None:
            continue
        prev = last.get(session)
        last[session] = r
        if prev is None:
            continue
        bs = prev.route.block_size
        full = prev.prompt_tokens // bs
        keys = r.route.block_keys
        end = min(len(keys), (prev.prompt_tokens + prev.output_tokens - 1) // bs)
        if end > full and list(keys[:full]) == list(prev.route.block_keys[:full]):
            prev.answer_keys = keys[full:end]


def load_trace(
    path: str | Path,
    fmt: str = "mooncake",
    *,
    block_size: int = 16,
    tokenizer: Any = None,
    default_output: int = 128,
    arrival_rate: float = 1.0,
    answers_in_history: bool = False,
) -> Trace:
    """Load ``path`` in format ``fmt`` ("mooncake" or "openai"; ``answers_in_history``:
    see :func:`load_openai`)."""
    p = Path(path)
    if fmt == "mooncake":
        return load_mooncake(p)
    if fmt == "openai":
        return load_openai(
            p,
            block_size=block_size,
            tokenizer=tokenizer,
            default_output=default_output,
            arrival_rate=arrival_rate,
            answers_in_history=answers_in_history,
        )
    raise TraceFormatError(f"unknown trace format {fmt!r}; use 'mooncake' or 'openai'")
