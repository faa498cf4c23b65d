"""The simulated pod's Responses API (``/v1/responses``), as vLLM serves it with
``VLLM_ENABLE_RESPONSES_API_STORE=1``: every response is stored in this pod's memory, so
``previous_response_id``, ``GET /v1/responses/{id}`` and ``POST .../cancel`` know only
this pod's responses (404 otherwise). Input is a string or a list of message /
function_call / function_call_output items, rendered as chat messages; the answer is
JSON or a stream of ``event:`` SSE events."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from router.sim.engine import SimEngine, SimRequest, output_text
from router.sim.execution import Execution
from router.sim.parsing import RequestParser
from router.sim.settings import SimSettings
from router.sim.wire import APIError, sse_event
from router.tokenize import PromptTokenizer, TokenizeError


class StoredResponse:
    """A response this pod created: the messages it rendered and its answer."""

    __slots__ = ("body", "messages", "text")

    def __init__(self, messages: list[dict[str, Any]], body: dict[str, Any]) -> None:
        self.messages = messages
        self.body = body
        self.text = ""


class ResponsesAPI:
    """``/v1/responses`` of one pod, with its store of responses."""

    def __init__(
        self,
        settings: SimSettings,
        engine: SimEngine,
        tokenizer: PromptTokenizer,
        parse: RequestParser,
        execution: Execution,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.tokenizer = tokenizer
        self.parse = parse
        self.execution = execution
        #: the Responses API store (vLLM's response_store + msg_store): id -> response
        self.responses: dict[str, StoredResponse] = {}

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

    async def create(self, request: Request) -> Response:
        body = await self.parse.body(request)
        self.parse.lora(body)
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
        req = self.parse.generation(gen_body, ids)
        stream, _ = self.parse.stream_flags(body)
        # vLLM 0.32's ResponsesRequest has kv_transfer_params too
        pd = await self.execution.disagg(body, request, req)
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
        await self.execution.run(req, request)
        entry.text = output_text(req.output_ids)
        entry.body = self._response_body(rid, body, "completed", created, entry.text, req)
        if store:
            self.responses[rid] = entry
        return self.execution.answer(entry.body, pd, req)

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
            return sse_event({"type": kind, "sequence_number": seq - 1, **fields})

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
        async with contextlib.aclosing(self.engine.generate(req)) as gen:
            added = False
            async for tok in gen:
                if not added:  # (vLLM: once the engine's first output is there)
                    added = True
                    yield event("response.output_item.added", output_index=0, item=item)
                yield event(
                    "response.output_text.delta",
                    item_id=item_id,
                    output_index=0,
                    content_index=0,
                    delta=chr(tok),
                    logprobs=[],
                )
            if not added:  # (no output at all)
                yield event("response.output_item.added", output_index=0, item=item)
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

    def get(self, response_id: str) -> JSONResponse:
        entry = self.responses.get(response_id)
        if entry is None:
            raise self._not_found(response_id)
        return JSONResponse(entry.body)

    def cancel(self, response_id: str) -> JSONResponse:
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
