"""The simulated pod's HTTP API, in vLLM's request and response shapes.

``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming SSE or not),
``POST /v1/responses`` (string or item-list input, streaming or not; every response is
stored in this pod's memory, as vLLM does with ``VLLM_ENABLE_RESPONSES_API_STORE=1``:
``previous_response_id``, ``GET /v1/responses/{id}`` and ``POST .../cancel`` know only
this pod's responses, 404 otherwise), ``GET /v1/models``, ``POST /v1/embeddings``,
``POST /tokenize``, ``GET /health``, ``POST /reset_prefix_cache``, ``GET /metrics``.
Errors are OpenAI error JSON ``{"error": {"message", "type", "param", "code"}}`` with
vLLM's types
(``NotFoundError`` 404 for an unknown model, ``BadRequestError`` 400 otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from router.sim.disagg import READ_PATH, KVLoadError, PDRequest, SimDisagg
from router.sim.engine import SimEngine, SimRequest, output_text
from router.sim.hashing import lora_path
from router.sim.settings import SimSettings
from router.tokenize import PromptTokenizer, TokenizeError

VLLM_VERSION = "0.32.0"


class APIError(Exception):
    """An error answered as OpenAI error JSON."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type_: str = "BadRequestError",
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type_
        self.param = param

    def response(self) -> JSONResponse:
        body = {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.status,
            }
        }
        return JSONResponse(body, status_code=self.status)


class ClientDisconnected(Exception):
    """The client went away before a non-streaming answer was ready."""


def _sse(obj: Mapping[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


_DONE = b"data: [DONE]\n\n"
_FP = f"vllm-{VLLM_VERSION}-sim"


def _sse_event(obj: Mapping[str, Any]) -> bytes:
    """One Responses API event as vLLM writes it: ``event: <type>`` then its data."""
    return (
        b"event: "
        + str(obj["type"]).encode()
        + b"\ndata: "
        + json.dumps(obj, separators=(",", ":")).encode()
        + b"\n\n"
    )


class StoredResponse:
    """A response this pod created: the messages it rendered and its answer."""

    __slots__ = ("body", "messages", "text")

    def __init__(self, messages: list[dict[str, Any]], body: dict[str, Any]) -> None:
        self.messages = messages
        self.body = body
        self.text = ""


class SimAPI:
    """Request parsing and response building for one pod."""

    def __init__(
        self,
        settings: SimSettings,
        engine: SimEngine,
        tokenizer: PromptTokenizer,
        pd: SimDisagg | None = None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.tokenizer = tokenizer
        self.pd = pd or SimDisagg(settings, engine)
        self.created = int(time.time())
        #: the Responses API store (vLLM's response_store + msg_store): id -> response
        self.responses: dict[str, StoredResponse] = {}

    # -- parsing ---------------------------------------------------------------------

    async def _body(self, request: Request) -> dict[str, Any]:
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

    def _lora(self, body: Mapping[str, Any]) -> str | None:
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
    def _opt_int(body: Mapping[str, Any], name: str, minimum: int) -> int | None:
        v = body.get(name)
        if v is None:
            return None
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise APIError(f"{name} must be an integer >= {minimum}, got {v!r}", param=name)
        return v

    @staticmethod
    def _opt_str(body: Mapping[str, Any], name: str) -> str | None:
        v = body.get(name)
        if v is None:
            return None
        if not isinstance(v, str):
            raise APIError(f"{name} must be a string, got {type(v).__name__}", param=name)
        return v

    def _chat_ids(self, body: Mapping[str, Any]) -> list[int]:
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

    def _prompt_ids(self, prompt: Any) -> list[int]:
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

    def _generation(self, body: Mapping[str, Any], prompt_ids: list[int]) -> SimRequest:
        lora = self._lora(body)
        n = self._opt_int(body, "n", 1)
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
        asked = self._opt_int(body, "max_completion_tokens", 1)
        if asked is None:
            asked = self._opt_int(body, "max_tokens", 1)
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
            cache_salt=self._opt_str(body, "cache_salt"),
        )
        return self.engine.prepare(req)

    @staticmethod
    def _stream_flags(body: Mapping[str, Any]) -> tuple[bool, bool]:
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise APIError("stream must be a boolean", param="stream")
        opts = body.get("stream_options") or {}
        if not isinstance(opts, dict):
            raise APIError("stream_options must be an object", param="stream_options")
        return stream, bool(opts.get("include_usage", False))

    # -- responses -------------------------------------------------------------------

    @staticmethod
    def _usage(req: SimRequest) -> dict[str, Any]:
        n, m = len(req.prompt_ids), len(req.output_ids)
        return {
            "prompt_tokens": n,
            "total_tokens": n + m,
            "completion_tokens": m,
            "prompt_tokens_details": {"cached_tokens": req.cached_tokens},
        }

    async def _run(self, req: SimRequest, request: Request) -> None:
        """Generate to the end; a client that disconnects first aborts the request
        (as vLLM does), freeing its queue place or running slot."""

        async def consume() -> None:
            async with contextlib.aclosing(self.engine.generate(req)) as gen:
                async for _ in gen:
                    pass

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        work = asyncio.create_task(consume())
        watch = asyncio.create_task(disconnected())
        try:
            await asyncio.wait((work, watch), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
            if not work.done():
                work.cancel()
            await asyncio.gather(work, watch, return_exceptions=True)
        if work.cancelled():
            raise ClientDisconnected()
        work.result()  # re-raises an engine error

    async def _disagg(
        self, body: Mapping[str, Any], request: Request, req: SimRequest
    ) -> PDRequest:
        """Parse ``kv_transfer_params`` and pull remote blocks (decode side) first."""
        pd = self.pd.parse(body, request.headers)
        try:
            await self.pd.receive(pd, req)
        except KVLoadError as exc:
            raise APIError(
                f"KV transfer failed (kv_load_failure_policy=fail): {exc}",
                status=500,
                type_="InternalServerError",
                param="kv_transfer_params",
            ) from None
        return pd

    def _with_params(self, out: dict[str, Any], pd: PDRequest, req: SimRequest) -> JSONResponse:
        params = self.pd.hold(pd, req)
        if params is not None:
            out["kv_transfer_params"] = params
        return JSONResponse(out)

    async def completions(self, request: Request) -> Response:
        body = await self._body(request)
        self._lora(body)
        if "prompt" not in body:
            raise APIError("prompt is required", param="prompt")
        req = self._generation(body, self._prompt_ids(body["prompt"]))
        stream, usage = self._stream_flags(body)
        pd = await self._disagg(body, request, req)
        rid = f"cmpl-{uuid.uuid4().hex[:16]}"
        model = body.get("model") or self.settings.model
        created = int(time.time())
        if stream:
            return self._stream(req, rid, model, created, usage, chat=False)
        await self._run(req, request)
        return self._with_params(
            {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "text": output_text(req.output_ids),
                        "logprobs": None,
                        "finish_reason": req.finish_reason,
                        "stop_reason": None,
                        "prompt_logprobs": None,
                    }
                ],
                "system_fingerprint": f"vllm-{VLLM_VERSION}-sim",
                "usage": self._usage(req),
            },
            pd,
            req,
        )

    async def chat_completions(self, request: Request) -> Response:
        body = await self._body(request)
        self._lora(body)
        req = self._generation(body, self._chat_ids(body))
        stream, usage = self._stream_flags(body)
        pd = await self._disagg(body, request, req)
        rid = f"chatcmpl-{uuid.uuid4().hex[:16]}"
        model = body.get("model") or self.settings.model
        created = int(time.time())
        if stream:
            return self._stream(req, rid, model, created, usage, chat=True)
        await self._run(req, request)
        return self._with_params(
            {
                "id": rid,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {
                            "role": "assistant",
                            "content": output_text(req.output_ids),
                            "refusal": None,
                            "tool_calls": [],
                            "reasoning": None,
                        },
                        "logprobs": None,
                        "finish_reason": req.finish_reason,
                        "stop_reason": None,
                    }
                ],
                "system_fingerprint": f"vllm-{VLLM_VERSION}-sim",
                "usage": self._usage(req),
            },
            pd,
            req,
        )

    def _stream(
        self, req: SimRequest, rid: str, model: str, created: int, usage: bool, *, chat: bool
    ) -> StreamingResponse:
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": rid, "object": obj, "created": created, "model": model}

        def chunk(choice: dict[str, Any]) -> bytes:
            return _sse({**head, "choices": [choice]})

        async def body() -> AsyncIterator[bytes]:
            async with contextlib.aclosing(self.engine.generate(req)) as gen:
                i = 0
                async for tok in gen:
                    last = i == req.max_tokens - 1
                    text = chr(tok)
                    reason = "length" if last else None
                    if chat:
                        if i == 0:
                            yield chunk(
                                {
                                    "index": 0,
                                    "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            )
                        choice: dict[str, Any] = {
                            "index": 0,
                            "delta": {"content": text},
                            "logprobs": None,
                            "finish_reason": reason,
                        }
                    else:  # vLLM sends stop_reason on every completion chunk
                        choice = {
                            "index": 0,
                            "text": text,
                            "logprobs": None,
                            "finish_reason": reason,
                            "stop_reason": None,
                        }
                    if last:
                        choice["stop_reason"] = None
                    if last and not usage:
                        # vLLM 0.32 stamps the fingerprint on the terminal chunk when no
                        # usage event follows (on the usage event when one does)
                        yield _sse({**head, "choices": [choice], "system_fingerprint": _FP})
                    else:
                        yield chunk(choice)
                    i += 1
            if usage:
                yield _sse(
                    {
                        **head,
                        "choices": [],
                        "usage": self._usage(req),
                        "system_fingerprint": _FP,
                    }
                )
            yield _DONE

        return StreamingResponse(body(), media_type="text/event-stream")

    # -- the Responses API -------------------------------------------------------------

    def _not_found(self, response_id: str) -> APIError:
        return APIError(
            f"Response with id '{response_id}' not found.",
            status=404,
            type_="invalid_request_error",
            param="response_id",
        )

    def _response_messages(
        self, body: Mapping[str, Any], previous: StoredResponse | None
    ) -> list[dict[str, Any]]:
        """The chat messages vLLM renders for a Responses request: instructions as a
        system message, the previous response's messages (less system ones) and answer,
        then the input (a string, or message / function_call / function_call_output
        items)."""
        messages: list[dict[str, Any]] = []
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise APIError("instructions must be a string", param="instructions")
        if instructions:
            messages.append({"role": "system", "content": instructions})
        if previous is not None:
            messages += [m for m in previous.messages if m.get("role") != "system"]
            messages.append({"role": "assistant", "content": previous.text})
        inp = body.get("input")
        if isinstance(inp, str):
            messages.append({"role": "user", "content": inp})
            return messages
        if not isinstance(inp, list):
            raise APIError("input must be a string or a list of input items", param="input")
        for item in inp:
            messages.append(self._item_message(item))
        return messages

    @staticmethod
    def _item_message(item: Any) -> dict[str, Any]:
        if not isinstance(item, dict):
            raise APIError("every input item must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "function_call":
            call = {
                "id": item.get("call_id"),
                "type": "function",
                "function": {"name": item.get("name"), "arguments": item.get("arguments")},
            }
            return {"role": "assistant", "content": None, "tool_calls": [call]}
        if kind == "function_call_output":
            return {
                "role": "tool",
                "content": item.get("output"),
                "tool_call_id": item.get("call_id"),
            }
        role = item.get("role")
        if kind != "message" or role not in ("user", "system", "developer", "assistant"):
            raise APIError(f"Unsupported input item type: {kind}", param="input")
        content = item.get("content")
        if isinstance(content, list):
            texts = [p.get("text") for p in content if isinstance(p, dict)]
            if not texts or not all(isinstance(t, str) for t in texts):
                raise APIError("content parts must be text parts", param="input")
            if role == "assistant":  # vLLM keeps the first part only
                return {"role": role, "content": texts[0]}
            return {"role": role, "content": [{"type": "text", "text": t} for t in texts]}
        if not isinstance(content, str):
            raise APIError("message content must be a string or a list of parts", param="input")
        return {"role": role, "content": content}

    def _response_body(
        self,
        rid: str,
        body: Mapping[str, Any],
        status: str,
        created: int,
        text: str | None = None,
        req: SimRequest | None = None,
    ) -> dict[str, Any]:
        output = []
        if text is not None:
            output.append(
                {
                    "id": f"msg_{rid[5:]}",
                    "type": "message",
                    "role": "assistant",
                    "status": "completed",
                    "content": [
                        {"type": "output_text", "text": text, "annotations": [], "logprobs": None}
                    ],
                }
            )
        usage = None
        if req is not None:
            n, m = len(req.prompt_ids), len(req.output_ids)
            usage = {
                "input_tokens": n,
                "input_tokens_details": {"cached_tokens": req.cached_tokens},
                "output_tokens": m,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": n + m,
            }
        return {
            "id": rid,
            "object": "response",
            "created_at": created,
            "model": body.get("model") or self.settings.model,
            "status": status,
            "instructions": body.get("instructions"),
            "previous_response_id": body.get("previous_response_id"),
            "output": output,
            "usage": usage,
            "store": body.get("store", True) is not False,
            "background": False,
        }

    async def create_response(self, request: Request) -> Response:
        body = await self._body(request)
        self._lora(body)
        if "input" not in body:
            raise APIError("input is required", param="input")
        previous: StoredResponse | None = None
        prev_id = body.get("previous_response_id")
        if prev_id is not None:
            previous = self.responses.get(prev_id) if isinstance(prev_id, str) else None
            if previous is None:
                raise self._not_found(str(prev_id))
        messages = self._response_messages(body, previous)
        tools = body.get("tools") or None
        chat_tools = None
        if tools is not None:
            if not isinstance(tools, list):
                raise APIError("tools must be a list", param="tools")
            chat_tools = [
                {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
                for t in tools
                if isinstance(t, dict) and t.get("type") == "function"
            ] or None
        try:
            ids = self.tokenizer.encode_chat(messages, tools=chat_tools)
        except TokenizeError as exc:
            raise APIError(str(exc), param="input") from None
        gen_body = {**body, "max_tokens": body.get("max_output_tokens")}
        gen_body.pop("max_completion_tokens", None)
        req = self._generation(gen_body, ids)
        stream, _ = self._stream_flags(body)
        pd = await self._disagg(body, request, req)  # vLLM 0.32's ResponsesRequest has them
        rid = f"resp_{uuid.uuid4().hex}"
        created = int(time.time())
        store = body.get("store", True) is not False
        entry = StoredResponse(messages, self._response_body(rid, body, "in_progress", created))
        if stream:
            if store:
                self.responses[rid] = entry
            return StreamingResponse(
                self._response_events(req, rid, body, created, entry),
                media_type="text/event-stream",
            )
        await self._run(req, request)
        entry.text = output_text(req.output_ids)
        entry.body = self._response_body(rid, body, "completed", created, entry.text, req)
        if store:
            self.responses[rid] = entry
        return self._with_params(entry.body, pd, req)

    async def _response_events(
        self,
        req: SimRequest,
        rid: str,
        body: Mapping[str, Any],
        created: int,
        entry: StoredResponse,
    ) -> AsyncIterator[bytes]:
        seq = 0

        def event(kind: str, **fields: Any) -> bytes:
            nonlocal seq
            seq += 1
            return _sse_event({"type": kind, "sequence_number": seq - 1, **fields})

        item_id = f"msg_{rid[5:]}"
        yield event("response.created", response=entry.body)
        yield event("response.in_progress", response=entry.body)
        item = {
            "id": item_id,
            "type": "message",
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }
        yield event("response.output_item.added", output_index=0, item=item)
        async with contextlib.aclosing(self.engine.generate(req)) as gen:
            async for tok in gen:
                yield event(
                    "response.output_text.delta",
                    item_id=item_id,
                    output_index=0,
                    content_index=0,
                    delta=chr(tok),
                    logprobs=[],
                )
        entry.text = output_text(req.output_ids)
        yield event(
            "response.output_text.done",
            item_id=item_id,
            output_index=0,
            content_index=0,
            text=entry.text,
            logprobs=[],
        )
        entry.body = self._response_body(rid, body, "completed", created, entry.text, req)
        yield event("response.output_item.done", output_index=0, item=entry.body["output"][0])
        yield event("response.completed", response=entry.body)

    def get_response(self, response_id: str) -> JSONResponse:
        entry = self.responses.get(response_id)
        if entry is None:
            raise self._not_found(response_id)
        return JSONResponse(entry.body)

    def cancel_response(self, response_id: str) -> JSONResponse:
        entry = self.responses.get(response_id)
        if entry is None:
            raise self._not_found(response_id)
        if entry.body["status"] not in ("queued", "in_progress"):
            raise APIError(
                "Cannot cancel a synchronous response.",
                type_="invalid_request_error",
                param="response_id",
            )
        entry.body = {**entry.body, "status": "cancelled"}
        return JSONResponse(entry.body)

    async def embeddings(self, request: Request) -> Response:
        body = await self._body(request)
        self._lora(body)
        inp = body.get("input")
        items: list[Any] = (
            inp if isinstance(inp, list) and inp and not isinstance(inp[0], int) else [inp]
        )
        vectors, total = [], 0
        for i, item in enumerate(items):
            if item is None:
                raise APIError("input is required", param="input")
            try:
                ids = self._prompt_ids(item)
            except APIError:
                raise APIError(
                    f"input[{i}] must be a non-empty string or list of token ids", param="input"
                ) from None
            if len(ids) > self.settings.max_model_len:
                raise APIError(
                    f"input[{i}] has {len(ids)} tokens, "
                    f"over max_model_len={self.settings.max_model_len}",
                    param="input",
                )
            total += len(ids)
            vectors.append({"index": i, "object": "embedding", "embedding": self._vector(ids)})
        return JSONResponse(
            {
                "id": f"embd-{uuid.uuid4().hex[:16]}",
                "object": "list",
                "created": int(time.time()),
                "model": body.get("model") or self.settings.model,
                "data": vectors,
                "usage": {"prompt_tokens": total, "total_tokens": total, "completion_tokens": 0},
            }
        )

    def _vector(self, ids: list[int]) -> list[float]:
        """A unit vector from sha256 of the token ids: same input, same vector."""
        dim = self.settings.embedding_dim
        seed = hashlib.sha256(json.dumps(ids).encode()).digest()
        raw: list[float] = []
        counter = 0
        while len(raw) < dim:
            block = hashlib.sha256(seed + counter.to_bytes(4, "big")).digest()
            raw += [(b - 127.5) / 127.5 for b in block]
            counter += 1
        raw = raw[:dim]
        norm = math.sqrt(sum(x * x for x in raw)) or 1.0
        return [x / norm for x in raw]

    async def tokenize(self, request: Request) -> Response:
        body = await self._body(request)
        self._lora(body)
        if "messages" in body:
            ids = self._chat_ids(body)
        elif "prompt" in body:
            if not isinstance(body["prompt"], str):
                raise APIError("prompt must be a string", param="prompt")
            ids = self._prompt_ids(body["prompt"])
        else:
            raise APIError("the body needs either 'prompt' or 'messages'", param="prompt")
        return JSONResponse(
            {
                "count": len(ids),
                "max_model_len": self.settings.max_model_len,
                "tokens": ids,
                "token_strs": None,
            }
        )

    def models(self) -> dict[str, Any]:
        s = self.settings

        def card(name: str, parent: str | None) -> dict[str, Any]:
            return {
                "id": name,
                "object": "model",
                "created": self.created,
                "owned_by": "vllm",
                "root": name if parent is None else lora_path(name),
                "parent": parent,
                "max_model_len": s.max_model_len,
            }

        return {
            "object": "list",
            "data": [card(s.model, None), *(card(a, s.model) for a in s.lora_adapters)],
        }


def build_app(
    settings: SimSettings,
    engine: SimEngine,
    tokenizer: PromptTokenizer,
    pd: SimDisagg | None = None,
) -> FastAPI:
    api = SimAPI(settings, engine, tokenizer, pd)
    app = FastAPI(
        title=f"kvroute sim {settings.pod_name}", docs_url=None, redoc_url=None, openapi_url=None
    )

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed"

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        engine.metrics.rejected(exc.status)
        return exc.response()

    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", api.chat_completions, methods=["POST"])
    app.add_api_route("/v1/embeddings", api.embeddings, methods=["POST"])
    app.add_api_route("/tokenize", api.tokenize, methods=["POST"])
    app.add_api_route("/v1/responses", api.create_response, methods=["POST"])
    app.add_api_route(READ_PATH, api.pd.read_endpoint, methods=["POST"])

    @app.get("/v1/responses/{response_id}")
    async def _get_response(response_id: str) -> JSONResponse:
        return api.get_response(response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def _cancel_response(response_id: str) -> JSONResponse:
        return api.cancel_response(response_id)

    @app.get("/v1/models")
    async def _models() -> JSONResponse:
        return JSONResponse(api.models())

    @app.get("/health")
    async def _health() -> Response:
        return Response(status_code=200)

    @app.get("/version")
    async def _version() -> JSONResponse:
        return JSONResponse({"version": VLLM_VERSION})

    @app.post("/reset_prefix_cache")
    async def _reset() -> JSONResponse:
        engine.reset_prefix_cache()
        return JSONResponse({"success": True})

    @app.get("/metrics")
    async def _metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    app.state.api = api
    app.state.pd = api.pd
    app.state.engine = engine
    return app
