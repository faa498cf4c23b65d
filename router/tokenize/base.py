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


class AsyncPromptTokenizer(Protocol):
    """The awaitable form the gateway calls for every tokenizer.

    :class:`~router.tokenize.remote.RemoteTokenizer` implements it natively; any
    :class:`PromptTokenizer` gets it from :func:`router.tokenize.aio.as_async` (inline for
    short prompts, a worker thread for long ones).  For ids *and* block keys with
    multi-turn reuse, use :class:`router.tokenize.encoder.ChatEncoder` instead.
    """

    name: str
    approximate: bool

    async def aencode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]: ...

    async def aencode_prompt(self, prompt: str) -> list[int]: ...
