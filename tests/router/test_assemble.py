"""Assembling a JSON answer from a pod's stream (router/proxy/assemble.py): which requests
are asked of their pod as a stream, and the JSON built from the SSE, whatever the chunk
boundaries.  The SSE below is vLLM 0.32's, as its CPU engine sent it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from router.decision.request import Routed, parse_body
from router.proxy.assemble import (
    Assembler,
    StreamFailed,
    StreamUnreadable,
    assemblable,
    one_token,
    streamed_body,
)
from scoring.policies.base import Decision, RouteRequest

HEAD = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m"}


def sse(*events: object) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)


def chat_chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
    """One chat chunk of one choice, as vLLM 0.32 frames it."""
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, **extra}
    return {**HEAD, "choices": [choice]}


USAGE = {"prompt_tokens": 11, "total_tokens": 14, "completion_tokens": 3}
CHAT_SSE = (
    sse(
        {**chat_chunk({"role": "assistant", "content": ""}), "prompt_token_ids": None},
        chat_chunk({"content": " about"}),
        chat_chunk({"content": " about"}),
        chat_chunk({"content": " met"}, "length", stop_reason=None),
        {**HEAD, "choices": [], "usage": USAGE, "system_fingerprint": "vllm-0.32.0"},
    )
    + b"data: [DONE]\n\n"
)


def routed_of(kind: str, body: dict[str, Any]) -> Routed:
    route = RouteRequest("r1", "m", 40, [1, 2], 16)
    stream = body.get("stream") is True
    return Routed(kind, body, "m", stream, route, Decision("p", {}), ["p"], {})  # type: ignore[arg-type]


def assembled(kind: str, sse: bytes, step: int | None = None) -> dict[str, Any]:
    whole = Assembler(kind)
    step = step or len(sse)
    for i in range(0, len(sse), step):
        whole.feed(sse[i : i + step])
    out: dict[str, Any] = json.loads(whole.answer())
    return out


@pytest.mark.parametrize("step", [None, 1, 7, 64])
def test_a_chat_stream_becomes_the_chat_completion_whatever_its_chunk_boundaries(
    step: int | None,
) -> None:
    assert assembled("chat", CHAT_SSE, step) == {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 7,
        "model": "m",
        "prompt_token_ids": None,
        "system_fingerprint": "vllm-0.32.0",
        "usage": USAGE,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": " about about met"},
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
        ],
    }


def test_a_text_completion_stream_becomes_the_text_completion() -> None:
    chunk = {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m"}
    events = [
        {**chunk, "choices": [{"index": 0, "text": " a", "finish_reason": None}]},
        {**chunk, "choices": [{"index": 0, "text": " b", "finish_reason": "stop"}]},
        {**chunk, "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}},
    ]
    out = assembled("completion", sse(*events) + b"data: [DONE]\n\n", 5)
    assert out["object"] == "text_completion"
    assert out["choices"] == [{"index": 0, "text": " a b", "finish_reason": "stop"}]
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 2}


X1 = '{"x": 1}'


def test_tool_calls_merge_by_index_and_their_arguments_concatenate() -> None:
    def delta(d: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {"id": "c", "choices": [{"index": 0, "delta": d, "finish_reason": finish}]}

    events = [
        delta({"role": "assistant", "reasoning_content": "think"}),
        delta({"reasoning_content": "ing"}),
        delta(
            {
                "tool_calls": [
                    {"index": 0, "id": "call_a", "type": "function", "function": {"name": "f"}}
                ]
            }
        ),
        delta({"tool_calls": [{"index": 0, "function": {"arguments": '{"x": '}}]}),
        delta({"tool_calls": [{"index": 1, "id": "call_b", "function": {"name": "g"}}]}),
        delta({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}),
        delta({"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]}, "tool_calls"),
    ]
    (choice,) = assembled("chat", sse(*events), 3)["choices"]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"] == {
        "role": "assistant",
        "content": None,
        "reasoning_content": "thinking",
        "tool_calls": [
            {
                "id": "call_a",
                "type": "function",
                "function": {"name": "f", "arguments": '{"x": 1}'},
            },
            {"id": "call_b", "type": "function", "function": {"name": "g", "arguments": "{}"}},
        ],
    }


@pytest.mark.parametrize("step", [None, 1, 2, 5])
def test_crlf_line_ends_and_sse_comments_are_read(step: int | None) -> None:
    body = CHAT_SSE.replace(b"data: [DONE]", b": keep-alive\n\ndata: [DONE]")
    out = assembled("chat", body.replace(b"\n", b"\r\n"), step)
    assert out["choices"][0]["message"]["content"] == " about about met"


def test_an_error_event_fails_the_answer_with_its_message() -> None:
    whole = Assembler("chat")
    whole.feed(CHAT_SSE[:300].rsplit(b"\n\n", 1)[0] + b"\n\n")  # a first chunk, then
    with pytest.raises(StreamFailed, match="engine died"):
        whole.feed(sse({"error": {"message": "engine died", "code": 500}}))


@pytest.mark.parametrize(
    "body",
    [b"", b"data: [DONE]\n\n", b"data: not json\n\n", b"data: [1, 2]\n\n", b'data: {"id": 1}\n\n'],
    ids=["empty", "done only", "not json", "not an object", "no choices"],
)
def test_a_stream_that_is_not_a_completion_is_unreadable(body: bytes) -> None:
    whole = Assembler("chat")
    with pytest.raises(StreamUnreadable):
        whole.feed(body)
        whole.answer()


@pytest.mark.parametrize(
    ("kind", "body", "expected"),
    [
        ("chat", {"messages": [{"role": "user", "content": "x"}]}, True),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "n": 1}, True),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "logprobs": False}, True),
        ("completion", {"prompt": "x"}, True),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "stream": True}, False),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "n": 2}, False),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "logprobs": True}, False),
        ("chat", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, False),
        ("completion", {"prompt": "x", "echo": True}, False),
        ("completion", {"prompt": "x", "logprobs": 1}, False),
        ("completion", {"prompt": "x", "prompt_logprobs": 1}, False),
        ("completion", {"prompt": "x", "best_of": 2}, False),
        ("completion", {"prompt": "x", "return_token_ids": True}, False),
        ("embedding", {"input": "x"}, False),
        ("completion", {"prompt": "x", "max_tokens": 1}, False),  # its head is its token
    ],
)
def test_only_what_a_stream_carries_whole_is_assembled(
    kind: str, body: dict[str, Any], expected: bool
) -> None:
    routed = routed_of(kind, {"model": "m", **body})
    assert assemblable(routed) is expected


def test_the_body_sent_on_asks_for_a_stream_with_its_usage_and_keeps_the_rest() -> None:
    raw = b'{"model": "m", "prompt": "x", "max_tokens": 3}'
    body = parse_body(raw)
    sent = json.loads(streamed_body(raw, body))
    assert sent == {
        "model": "m",
        "prompt": "x",
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    assert "stream" not in body  # the client's body is unchanged
    raw = b'{"model": "m", "prompt": "x", "stream": false, "stream_options": null}'
    sent = json.loads(streamed_body(raw, parse_body(raw)))
    assert (sent["stream"], sent["stream_options"]) == (True, {"include_usage": True})


@pytest.mark.parametrize(
    ("kind", "body", "expected"),
    [
        ("completion", {"prompt": "x", "max_tokens": 1}, True),
        ("completion", {"prompt": "x", "max_tokens": 0}, True),
        ("chat", {"messages": [], "max_completion_tokens": 1}, True),
        ("chat", {"messages": [], "max_completion_tokens": 1, "max_tokens": 9}, True),
        ("chat", {"messages": [], "max_tokens": 1}, True),
        ("completion", {"prompt": "x", "max_tokens": 2}, False),
        ("completion", {"prompt": "x"}, False),  # the engine's default: many
        ("completion", {"prompt": "x", "max_tokens": True}, False),  # not a number
        ("completion", {"prompt": "x", "max_tokens": 1, "stream": True}, False),
        ("embedding", {"input": "x", "max_tokens": 1}, False),
    ],
)
def test_an_answer_of_at_most_one_token_has_its_first_token_in_its_head(
    kind: str, body: dict[str, Any], expected: bool
) -> None:
    assert one_token(routed_of(kind, {"model": "m", **body})) is expected
