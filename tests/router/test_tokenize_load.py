"""load_tokenizer specs, the approximate tokenizer and content-format detection."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.tokenize import (
    ApproxTokenizer,
    ByteTokenizer,
    TokenizeError,
    load_tokenizer,
)
from router.tokenize.conversation import detect_content_format
from router.tokenize.hf import HFTokenizer, TokenizerFilesError
from router.tokenize.remote import RemoteTokenizer
from tests.fixtures.tokenizers.build import fixture_dirs


def test_builtin_and_empty_specs_give_the_byte_tokenizer() -> None:
    assert isinstance(load_tokenizer("builtin"), ByteTokenizer)
    assert isinstance(load_tokenizer(""), ByteTokenizer)


def test_approx_specs_set_characters_per_token() -> None:
    four = load_tokenizer("approx")
    two = load_tokenizer("approx:2")
    assert isinstance(four, ApproxTokenizer) and four.approximate
    assert isinstance(two, ApproxTokenizer)
    assert (four.chars_per_token, two.chars_per_token) == (4, 2)
    assert len(two.encode_prompt("abcdefgh")) == 4
    assert len(four.encode_prompt("abcdefghi")) == 3  # ceil(9 / 4)


@pytest.mark.parametrize("spec", ["approx:0", "approx:x", "approx:-3"])
def test_bad_approx_spec_is_rejected_with_its_value(spec: str) -> None:
    with pytest.raises(TokenizeError, match="bad approx tokenizer spec"):
        load_tokenizer(spec)


def test_remote_spec_lists_urls_and_keeps_the_model() -> None:
    tok = load_tokenizer("remote:http://127.0.0.1:1,http://127.0.0.1:2/", model="m")
    assert isinstance(tok, RemoteTokenizer)
    assert tok.base_urls == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert tok.model == "m" and tok.name == "remote:http://127.0.0.1:1"


@pytest.mark.parametrize("spec", ["remote:", "remote:127.0.0.1:8000"])
def test_bad_remote_spec_is_rejected(spec: str) -> None:
    with pytest.raises(TokenizeError, match="bad remote tokenizer spec"):
        load_tokenizer(spec)


def test_directory_spec_loads_the_hf_tokenizer() -> None:
    tok = load_tokenizer(str(fixture_dirs()["chatml"]))
    assert isinstance(tok, HFTokenizer) and not tok.approximate
    assert tok.name.startswith("hf:")


def test_unknown_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerFilesError, match="no tokenizer"):
        load_tokenizer(str(tmp_path / "nope"))


def test_approx_ids_are_deterministic_and_prefix_stable() -> None:
    tok = ApproxTokenizer(4)
    a = tok.encode_prompt("The quick brown fox jumps")
    b = tok.encode_prompt("The quick brown fox sleeps all day")
    assert a[:4] == b[:4] and a != b
    assert a == ApproxTokenizer(4).encode_prompt("The quick brown fox jumps")
    assert all(0 <= t < 2**31 for t in a)


def test_approx_chat_covers_tools_tool_calls_and_content_parts() -> None:
    tok = ApproxTokenizer(1)
    plain = tok.encode_chat([{"role": "user", "content": "hi"}])
    with_tools = tok.encode_chat(
        [{"role": "user", "content": "hi"}], tools=[{"type": "function", "function": {"name": "f"}}]
    )
    assert len(with_tools) > len(plain)
    parts = tok.encode_chat([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
    assert parts == plain
    with pytest.raises(TokenizeError, match="must not be empty"):
        tok.encode_chat([])


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "string"),
        (
            "{% for m in messages %}{% for p in m['content'] %}"
            "{{ p.text }}{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% for m in messages %}{% for p in m.content | list %}"
            "{{ p.text }}{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% set msgs = messages[1:] %}{% for m in msgs %}"
            "{% for p in m.content %}{{ p }}{% endfor %}{% endfor %}",
            "openai",
        ),
        (
            "{% macro render(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
            "{% for m in messages %}{{ render(m.content) }}{% endfor %}",
            "openai",
        ),
        ("{{ messages[0]['content'] }", "string"),  # syntax error: vLLM falls back to string
    ],
)
def test_content_format_detection_follows_vllm(template: str, expected: str) -> None:
    assert detect_content_format(template) == expected
