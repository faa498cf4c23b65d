"""The answers of ``/v1/completions`` and ``/v1/chat/completions`` in vLLM's shapes:
the whole JSON answer, or the SSE stream of chunks (with the usage chunk when
``stream_options.include_usage`` asks for it)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from router.sim.engine import SimEngine, SimRequest, output_text
from router.sim.wire import DONE, FINGERPRINT, sse


def usage(req: SimRequest) -> dict[str, Any]:
    """The ``usage`` object of a finished request."""
    n, m = len(req.prompt_ids), len(req.output_ids)
    return {
        "prompt_tokens": n,
        "total_tokens": n + m,
        "completion_tokens": m,
        "prompt_tokens_details": {"cached_tokens": req.cached_tokens},
    }


def _answer(
    req: SimRequest, obj: str, rid: str, model: str, created: int, choice: dict[str, Any]
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "choices": [choice],
        "system_fingerprint": FINGERPRINT,
        "usage": usage(req),
    }


def completion_json(req: SimRequest, rid: str, model: str, created: int) -> dict[str, Any]:
    """The non-streaming answer of ``/v1/completions``."""
    choice: dict[str, Any] = {
        "index": 0,
        "text": output_text(req.output_ids),
        "logprobs": None,
        "finish_reason": req.finish_reason,
        "stop_reason": None,
        "prompt_logprobs": None,
    }
    return _answer(req, "text_completion", rid, model, created, choice)


def chat_completion_json(req: SimRequest, rid: str, model: str, created: int) -> dict[str, Any]:
    """The non-streaming answer of ``/v1/chat/completions``."""
    message: dict[str, Any] = {
        "role": "assistant",
        "content": output_text(req.output_ids),
        "refusal": None,
        "tool_calls": [],
        "reasoning": None,
    }
    choice: dict[str, Any] = {
        "index": 0,
        "message": message,
        "logprobs": None,
        "finish_reason": req.finish_reason,
        "stop_reason": None,
    }
    return _answer(req, "chat.completion", rid, model, created, choice)


def stream_answer(
    engine: SimEngine,
    req: SimRequest,
    rid: str,
    model: str,
    created: int,
    include_usage: bool,
    *,
    chat: bool,
) -> StreamingResponse:
    """The streamed answer: one chunk per token, then the usage chunk if asked, then
    ``[DONE]``."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    head = {"id": rid, "object": obj, "created": created, "model": model}

    def chunk(choice: dict[str, Any]) -> bytes:
        return sse({**head, "choices": [choice]})

    async def body() -> AsyncIterator[bytes]:
        async with contextlib.aclosing(engine.generate(req)) as gen:
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
                if last and not include_usage:
                    # vLLM 0.32 stamps the fingerprint on the terminal chunk when no
                    # usage event follows (on the usage event when one does)
                    yield sse({**head, "choices": [choice], "system_fingerprint": FINGERPRINT})
                else:
                    yield chunk(choice)
                i += 1
        if include_usage:
            yield sse(
                {
                    **head,
                    "choices": [],
                    "usage": usage(req),
                    "system_fingerprint": FINGERPRINT,
                }
            )
        yield DONE

    return StreamingResponse(body(), media_type="text/event-stream")
