"""router.usage: the usage of an answer, read without building the rest of it."""

from __future__ import annotations

import json

from router.usage import Usage, UsageReader, usage_of_json


def _answer(usage: object, **extra: object) -> bytes:
    body = {
        "id": "cmpl-1",
        "object": "text_completion",
        "choices": [{"index": 0, "text": "a long answer " * 50, "finish_reason": "stop"}],
        "usage": usage,
        **extra,
    }
    return json.dumps(body).encode()


def test_a_completions_usage_is_read_with_its_cached_tokens() -> None:
    usage = {
        "prompt_tokens": 40,
        "completion_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 32},
    }
    assert usage_of_json(_answer(usage)) == Usage(40, 7, 32)


def test_a_responses_api_usage_uses_its_own_field_names() -> None:
    usage = {"input_tokens": 12, "output_tokens": 3, "input_tokens_details": {"cached_tokens": 0}}
    assert usage_of_json(_answer(usage)) == Usage(12, 3, 0)


def test_an_empty_prompt_details_falls_back_to_the_input_details() -> None:
    usage = {
        "prompt_tokens": 5,
        "completion_tokens": 1,
        "prompt_tokens_details": {},
        "input_tokens_details": {"cached_tokens": 4},
    }
    assert usage_of_json(_answer(usage)) == Usage(5, 1, 4)


def test_an_explicit_null_prompt_count_is_no_usage_even_with_input_tokens() -> None:
    usage = {"prompt_tokens": None, "input_tokens": 5, "completion_tokens": 1}
    assert usage_of_json(_answer(usage)) is None


def test_counts_of_the_wrong_type_are_no_usage_and_a_bad_cached_count_is_unknown() -> None:
    assert usage_of_json(_answer({"prompt_tokens": "5", "completion_tokens": 1})) is None
    bad_cached = {
        "prompt_tokens": 5,
        "completion_tokens": 1,
        "prompt_tokens_details": {"cached_tokens": "4"},
    }
    assert usage_of_json(_answer(bad_cached)) == Usage(5, 1, None)


def test_answers_without_a_usage_object_have_none() -> None:
    assert usage_of_json(_answer(None)) is None
    assert usage_of_json(_answer([1, 2])) is None
    assert usage_of_json(b"[1, 2, 3]") is None  # JSON, but not an object
    assert usage_of_json(b'"usage"') is None
    assert usage_of_json(b"{not json") is None
    assert usage_of_json(b"") is None


def test_a_responses_stream_event_carries_its_usage_inside_the_response() -> None:
    event = {
        "type": "response.completed",
        "response": {"id": "resp_1", "usage": {"input_tokens": 9, "output_tokens": 2}},
    }
    reader = UsageReader(event_stream=True)
    reader.feed(b"data: " + json.dumps({"type": "response.created"}).encode() + b"\n\n")
    reader.feed(b"data: " + json.dumps(event).encode() + b"\n\n")
    assert reader.usage() == Usage(9, 2, None)
