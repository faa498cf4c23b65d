"""The tokenizer interface the router and the simulated pod share."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol


class TokenizeError(ValueError):
    """The prompt cannot be rendered or tokenized; the message says why."""


class PromptTokenizer(Protocol):
    #: a short name for metrics and /v1/route ("builtin", "hf:<dir>", "remote", "approx")
    name: str
    #: True when token ids are only an estimate (approximate mode)
    approximate: bool

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Render the chat template and tokenize, as vLLM's chat endpoint does
        (special tokens come from the template, none are added)."""
        ...

    def encode_prompt(self, prompt: str) -> list[int]:
        """Tokenize a completion prompt, as vLLM's completions endpoint does
        (``add_special_tokens=True``)."""
        ...
