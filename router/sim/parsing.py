"""Reading a request to the simulated pod: the JSON body, the model or LoRA adapter it
names, the prompt (chat messages or a completion prompt) as token ids, and the
generation limits vLLM checks, each refused with vLLM's error message."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from fastapi import Request

from router.sim.engine import SimEngine, SimRequest
from router.sim.settings import SimSettings
from router.sim.wire import APIError
from router.tokenize import PromptTokenizer, TokenizeError


class RequestParser:
    """Request parsing for one pod: what it serves and how it tokenizes."""

    def __init__(
        self, settings: SimSettings, engine: SimEngine, tokenizer: PromptTokenizer
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.tokenizer = tokenizer

    async def body(self, request: Request) -> dict[str, Any]:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(f"invalid JSON body: {exc}", param="body") from None
        if not isinstance(body, dict):
            raise APIError(
                f"the request body must be a JSON object, got {type(body).__name__}", param="body"
            )
        return body

    def lora(self, body: Mapping[str, Any]) -> str | None:
        """The LoRA adapter the request names (None: the base model); 404 if unknown."""
        model = body.get("model")
        if model is None or model == self.settings.model:
            return None
        if isinstance(model, str) and model in self.settings.lora_adapters:
            return model
        valid = ", ".join([self.settings.model, *self.settings.lora_adapters])
        raise APIError(
            f"The model `{model}` does not exist. Valid aliases: {valid}.",
            status=404,
            type_="NotFoundError",
            param="model",
        )

    @staticmethod
    def opt_int(body: Mapping[str, Any], name: str, minimum: int) -> int | None:
        v = body.get(name)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise APIError(f"{name} must be an integer >= {minimum}, got {v!r}", param=name)
        return v

    @staticmethod
    def opt_str(body: Mapping[str, Any], name: str) -> str | None:
        v = body.get(name)
        if v is None:
            return None
        if not isinstance(v, str):
            raise APIError(f"{name} must be a string, got {type(v).__name__}", param=name)
        return v

    def chat_ids(self, body: Mapping[str, Any]) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise APIError("messages must be a list of message objects", param="messages")
        if not messages:
            raise APIError(
                "Cannot apply chat template to an empty conversation. "
                "Provide at least one message.",
                param="messages",
            )
        tools = body.get("tools")
        if tools is not None and not isinstance(tools, list):
            raise APIError("tools must be a list", param="tools")
        kwargs = body.get("chat_template_kwargs")
        if kwargs is not None and not isinstance(kwargs, dict):
            raise APIError("chat_template_kwargs must be an object", param="chat_template_kwargs")
        agp = body.get("add_generation_prompt", True)
        if not isinstance(agp, bool):
            raise APIError("add_generation_prompt must be a boolean", param="add_generation_prompt")
        try:
            return self.tokenizer.encode_chat(
                messages, tools=tools, add_generation_prompt=agp, chat_template_kwargs=kwargs
            )
        except TokenizeError as exc:
            raise APIError(str(exc), param="messages") from None

    def prompt_ids(self, prompt: Any) -> list[int]:
        """A completion prompt: a string, token ids, or a batch of exactly one of those."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            try:
                return self.tokenizer.encode_prompt(prompt)
            except TokenizeError as exc:
                raise APIError(str(exc), param="prompt") from None
        if (
            isinstance(prompt, list)
            and prompt
            and all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in prompt
            )
        ):
            return list(prompt)
        if (
            isinstance(prompt, list)
            and len(prompt) > 1
            and all(isinstance(p, str | list) for p in prompt)
        ):
            raise APIError(
                "the simulated pod serves one prompt per request, not a batch", param="prompt"
            )
        raise APIError(
            "prompt must be a non-empty string or a non-empty list of token ids in [0, 2**32)",
            param="prompt",
        )

    def generation(self, body: Mapping[str, Any], prompt_ids: list[int]) -> SimRequest:
        lora = self.lora(body)
        n = self.opt_int(body, "n", 1)
        if n not in (None, 1):
            raise APIError("the simulated pod supports n=1 only", param="n")
        limit = self.settings.max_model_len
        if len(prompt_ids) > limit:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, your prompt "
                f"contains at least {len(prompt_ids)} input tokens, which exceeds this limit even "
                f"without any output tokens. Please reduce the length of the input prompt. "
                f"(parameter=input_tokens, value={len(prompt_ids)})",
                param="input_tokens",
            )
        room = limit - len(prompt_ids)
        asked = self.opt_int(body, "max_completion_tokens", 1)
        if asked is None:
            asked = self.opt_int(body, "max_tokens", 1)
        if asked is not None and asked > room:
            raise APIError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(prompt_ids) + asked} tokens ({len(prompt_ids)} in the messages, {asked} in "
                f"the completion). Please reduce the length of the messages or completion.",
                param="max_tokens",
            )
        max_tokens = asked if asked is not None else min(self.settings.output_tokens, room)
        if max_tokens < 1:
            raise APIError(
                f"the prompt ({len(prompt_ids)} tokens) leaves no room for output within "
                f"max_model_len={limit}",
                param="input_tokens",
            )
        req = SimRequest(
            prompt_ids=prompt_ids,
            max_tokens=max_tokens,
            lora=lora,
            cache_salt=self.opt_str(body, "cache_salt"),
        )
        return self.engine.prepare(req)

    @staticmethod
    def stream_flags(body: Mapping[str, Any]) -> tuple[bool, bool]:
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise APIError("stream must be a boolean", param="stream")
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise APIError("stream_options must be an object", param="stream_options")
        return stream, bool(opts.get("include_usage", False))
