"""A character-block estimate of the token stream, for when no tokenizer is available.

The prompt is rendered to ChatML-style text (the same text :class:`ByteTokenizer` renders,
so tools and content parts are handled alike), then cut into consecutive chunks of
``chars_per_token`` characters (default 4, a common average for English BPE).  Each
chunk's id is ``xxh3_64(chunk) mod 2**31`` — deterministic across processes and
replicas, so two prompts that share a textual prefix share the leading "tokens" and
hence the leading block keys, which is all prefix routing needs.

Counts and block boundaries only approximate the engine's, so every result is flagged
``approximate = True`` (metrics and ``/v1/route`` report it).  A chat template may differ
from the model's; shared-prefix detection still works because it compares requests with
each other, not with the engine's own hashes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import xxhash

from router.tokenize.base import TokenizeError
from router.tokenize.builtin import _content_text

_h64 = xxhash.xxh3_64_intdigest
_MOD = 1 << 31


class ApproxTokenizer:
    """``ceil(len(text) / chars_per_token)`` pseudo-tokens, one per character chunk."""

    approximate = True

    def __init__(self, chars_per_token: int = 4) -> None:
        if not isinstance(chars_per_token, int) or chars_per_token < 1:
            raise ValueError(f"chars_per_token must be a positive integer, got {chars_per_token!r}")
        self.chars_per_token = chars_per_token
        self.name = f"approx:{chars_per_token}"

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
            raise TokenizeError("messages must be a list of message objects")
        if not messages:
            raise TokenizeError("messages must not be empty")
        parts = []
        if tools:
            parts.append(
                "<|im_start|>tools\n" + json.dumps(list(tools), sort_keys=True) + "<|im_end|>\n"
            )
        for i, msg in enumerate(messages):
            if not isinstance(msg, Mapping) or not isinstance(msg.get("role"), str):
                raise TokenizeError(f"messages[{i}] must be an object with a string 'role'")
            body = _content_text(msg.get("content"))
            if msg.get("tool_calls"):
                body += json.dumps(msg["tool_calls"], sort_keys=True)
            parts.append(f"<|im_start|>{msg['role']}\n{body}<|im_end|>\n")
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)

    def encode_text(self, text: str) -> list[int]:
        n = self.chars_per_token
        return [
            _h64(text[i : i + n].encode("utf-8", "surrogatepass")) % _MOD
            for i in range(0, len(text), n)
        ]

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        text = self.render_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt)
        return self.encode_text(text)

    def encode_prompt(self, prompt: str) -> list[int]:
        if not isinstance(prompt, str):
            raise TokenizeError(f"prompt must be a string, got {type(prompt).__name__}")
        return self.encode_text(prompt)
