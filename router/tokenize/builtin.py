"""A byte-level tokenizer with a ChatML-style template: no model files needed."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from router.tokenize.base import TokenizeError


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        parts = []
        for part in content:
            if isinstance(part, Mapping) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise TokenizeError(
        f"message content must be a string or a list of parts, got {type(content).__name__}"
    )


class ByteTokenizer:
    """Token id = UTF-8 byte value; BOS = 256.  Deterministic and exact by construction."""

    name = "builtin"
    approximate = False
    BOS = 256

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        out = [self.BOS]
        if tools:
            import json

            out += self._bytes(
                "<|im_start|>tools\n" + json.dumps(list(tools), sort_keys=True) + "<|im_end|>\n"
            )
        for i, msg in enumerate(messages):
            if not isinstance(msg, Mapping) or "role" not in msg:
                raise TokenizeError(f"messages[{i}] must be an object with a 'role'")
            out += self._bytes(
                f"<|im_start|>{msg['role']}\n{_content_text(msg.get('content'))}<|im_end|>\n"
            )
        if add_generation_prompt:
            out += self._bytes("<|im_start|>assistant\n")
        return out

    def encode_prompt(self, prompt: str) -> list[int]:
        return [self.BOS, *self._bytes(prompt)]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    @staticmethod
    def _bytes(text: str) -> list[int]:
        return list(text.encode("utf-8"))
