"""Changing a forwarded body: only top-level fields, the client's bytes kept when the
body only gains fields, the same JSON values otherwise."""

from __future__ import annotations

import json

from router.rewrite import rewrite_body


def _parsed(raw: bytes) -> dict:
    return json.loads(raw)


def test_nothing_to_change_returns_the_very_bytes() -> None:
    raw = b'{"model": "m",  "prompt": "hi"}'
    assert rewrite_body(raw, _parsed(raw)) is raw
    assert rewrite_body(raw, _parsed(raw), drop=["absent"]) is raw


def test_a_new_field_is_spliced_before_the_closing_brace() -> None:
    raw = b'{"model": "m",  "prompt": "h\\u00e9"}\n'
    out = rewrite_body(raw, _parsed(raw), set_fields={"cache_salt": "t-1"})
    assert out == b'{"model": "m",  "prompt": "h\\u00e9","cache_salt":"t-1"}'
    assert _parsed(out) == {"model": "m", "prompt": "hé", "cache_salt": "t-1"}


def test_an_empty_object_gains_fields_without_a_stray_comma() -> None:
    assert _parsed(rewrite_body(b"{ }", {}, set_fields={"a": 1})) == {"a": 1}


def test_a_replaced_or_dropped_field_reencodes_the_same_values_in_order() -> None:
    raw = b'{"model":"m","stream":true,"stream_options":{"include_usage":true},"max_tokens":9}'
    body = _parsed(raw)
    out = rewrite_body(
        raw, body, set_fields={"stream": False, "max_tokens": 1}, drop=["stream_options"]
    )
    assert list(_parsed(out)) == ["model", "stream", "max_tokens"]
    assert _parsed(out) == {"model": "m", "stream": False, "max_tokens": 1}
    assert body["stream"] is True  # the parsed body the decision used is not changed


def test_a_client_value_is_overridden_not_duplicated() -> None:
    raw = b'{"model":"m","cache_salt":"client-chosen"}'
    out = rewrite_body(raw, _parsed(raw), set_fields={"cache_salt": "tenant"})
    assert out.count(b"cache_salt") == 1 and _parsed(out)["cache_salt"] == "tenant"
