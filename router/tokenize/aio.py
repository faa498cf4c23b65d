"""Awaitable tokenization for any :class:`~router.tokenize.base.PromptTokenizer`."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any, cast

from router.tokenize.base import AsyncPromptTokenizer, PromptTokenizer


def chat_chars(messages: Sequence[Any]) -> int:
    """Characters of text content in ``messages`` (decides inline vs thread)."""
    total = 0
    for msg in messages:
        content = msg.get("content") if isinstance(msg, Mapping) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(str(p.get("text", ""))) for p in content if isinstance(p, Mapping))
    return total


class ThreadedTokenizer:
    """Runs a sync tokenizer inline when the prompt is short (< ``offload_chars``
    characters), else in a worker thread so the event loop keeps serving."""

    def __init__(self, tokenizer: PromptTokenizer, *, offload_chars: int = 16_384) -> None:
        self.tokenizer = tokenizer
        self.offload_chars = offload_chars
        self.name = tokenizer.name
        self.approximate = tokenizer.approximate

    async def aencode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        kwargs: dict[str, Any] = dict(
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
        )
        if isinstance(messages, Sequence) and chat_chars(messages) > self.offload_chars:
            return await asyncio.to_thread(self.tokenizer.encode_chat, messages, **kwargs)
        return self.tokenizer.encode_chat(messages, **kwargs)

    async def aencode_prompt(self, prompt: str) -> list[int]:
        if isinstance(prompt, str) and len(prompt) > self.offload_chars:
            return await asyncio.to_thread(self.tokenizer.encode_prompt, prompt)
        return self.tokenizer.encode_prompt(prompt)


def as_async(tokenizer: PromptTokenizer, *, offload_chars: int = 16_384) -> AsyncPromptTokenizer:
    """``tokenizer`` itself if it already has ``aencode_chat`` (remote), else a
    :class:`ThreadedTokenizer` around it."""
    if hasattr(tokenizer, "aencode_chat") and hasattr(tokenizer, "aencode_prompt"):
        return cast(AsyncPromptTokenizer, tokenizer)
    return ThreadedTokenizer(tokenizer, offload_chars=offload_chars)
