"""Tokenizing a validated request with its model's encoder (:class:`~.plan.Encoding`):
the token ids and block keys of a chat (its template, tools and template kwargs), a
completion (text or token ids) or a Responses body converted to chat, each timed in
the encoder's histogram.  A tokenizer's failure is 400 ``tokenize_failed``."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from router.decision.plan import Encoding
from router.decision.request import Kind
from router.errors import bad_request
from router.tokenize import EncodedPrompt, TokenizeError

_perf = time.perf_counter


async def encode(
    kind: Kind,
    body: Mapping[str, Any],
    prompt: Any,
    entry: Encoding,
    lora: str | None,
) -> EncodedPrompt:
    """``prompt``: the validated messages (chat), :func:`first_prompt` (completion)
    or :func:`router.decision.responses.to_chat`'s messages (responses, whose ``body`` is then
    the chat body of its tools and template kwargs).  A local tokenizer on a short
    prompt runs inline (no coroutine, no thread)."""
    encoder = entry.encoder
    salt = body.get("cache_salt")
    cache_salt = salt if isinstance(salt, str) and salt else None
    t0 = _perf()
    try:
        if kind == "responses":  # messages and chat-format tools from to_chat
            kwargs = body.get("chat_template_kwargs")
            return await encoder.aencode_responses(
                prompt,
                tools=body.get("tools"),
                chat_template_kwargs=kwargs if isinstance(kwargs, dict) else None,
                lora=lora,
                cache_salt=cache_salt,
            )
        if kind == "chat":
            tools = body.get("tools")
            if tools is not None and not isinstance(tools, list):
                raise bad_request("'tools' must be a list", "invalid_tools", param="tools")
            kwargs = body.get("chat_template_kwargs")
            if kwargs is not None and not isinstance(kwargs, dict):
                raise bad_request(
                    "'chat_template_kwargs' must be an object",
                    "invalid_chat_template_kwargs",
                    param="chat_template_kwargs",
                )
            agp = body.get("add_generation_prompt", True)
            if body.get("continue_final_message"):
                agp = False
            return await encoder.aencode_chat(
                prompt,
                tools=tools,
                add_generation_prompt=bool(agp),
                chat_template_kwargs=kwargs,
                lora=lora,
                cache_salt=cache_salt,
            )
        if isinstance(prompt, list):  # token ids: nothing to tokenize
            ids = list(prompt)
            keys = encoder.hasher.keys(ids, lora=lora, cache_salt=cache_salt)
            return EncodedPrompt(ids, keys)
        return await encoder.aencode_prompt(prompt, lora=lora, cache_salt=cache_salt)
    except TokenizeError as exc:
        raise bad_request(f"cannot tokenize the request: {exc}", "tokenize_failed") from None
    finally:
        entry.hist.observe(_perf() - t0)


# -- the path ----------------------------------------------------------------------


def encode_now(
    entry: Encoding, prompt: str, lora: str | None, body: Mapping[str, Any]
) -> EncodedPrompt:
    """The common completion, a text prompt its local tokenizer takes inline
    (``entry.encoder.inline_prompt``): what :func:`encode` does, minus its coroutine."""
    salt = body.get("cache_salt")
    t_tok = _perf()
    try:
        return entry.encoder.encode_prompt(
            prompt, lora=lora, cache_salt=salt if isinstance(salt, str) and salt else None
        )
    except TokenizeError as exc:
        raise bad_request(f"cannot tokenize the request: {exc}", "tokenize_failed") from None
    finally:
        entry.hist.observe(_perf() - t_tok)
