"""A fake OpenAI-compatible backend that costs what a real server's HTTP layer costs.

    python tests/bench/fake_backend.py --port 8101 --name b0

FastAPI on uvicorn (uvloop + httptools, the stack vLLM's API server runs on), answering
at once: ``POST /v1/completions`` and ``/v1/chat/completions`` parse the JSON body and
answer a small completion JSON (or, with ``"stream": true``, ``max_tokens`` SSE events
and ``data: [DONE]``); ``POST /tokenize`` answers vLLM's shape (one token per 4 prompt
characters, at least one); ``GET /health``, ``/v1/models``, ``/metrics`` (no series),
and the probes sglang-router sends (``/server_info``, ``/model_info``,
``/get_model_info``).  No engine, no KV events: what is left is the per-request cost of
the HTTP layer and the JSON, so a router in front of it is measured against the part of
a real server that a router also has to pay (tests/bench/bench_wrk_overhead.py).

Prints one JSON line ``{"url": ...}`` on stdout once it listens.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict


class _Sampling(BaseModel):
    """The sampling fields an OpenAI server validates on every request."""

    model_config = ConfigDict(extra="allow")
    model: str
    max_tokens: int | None = 16
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    n: int = 1
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | bool | None = None
    user: str | None = None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage]


def build_app(name: str, model: str) -> FastAPI:
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    counter = iter(range(1 << 62))

    def completion(body: dict[str, Any], chat: bool) -> dict[str, Any]:
        rid = f"cmpl-{name}-{next(counter)}"
        text = "ok"
        choice: dict[str, Any] = (
            {"index": 0, "message": {"role": "assistant", "content": text}}
            if chat
            else {"index": 0, "text": text, "logprobs": None}
        )
        choice["finish_reason"] = "length"
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.get("model", model),
            "choices": [choice],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }

    async def events(body: dict[str, Any], chat: bool) -> AsyncIterator[bytes]:
        rid = f"cmpl-{name}-{next(counter)}"
        obj = "chat.completion.chunk" if chat else "text_completion"
        for _ in range(int(body.get("max_tokens") or 1)):
            delta: dict[str, Any] = {"content": "x"} if chat else {}
            choice = {"index": 0, **({"delta": delta} if chat else {"text": "x"})}
            chunk = {
                "id": rid,
                "object": obj,
                "model": body.get("model", model),
                "choices": [choice],
            }
            yield b"data: " + json.dumps(chunk).encode() + b"\n\n"
        yield b"data: [DONE]\n\n"

    async def generate(body: dict[str, Any], chat: bool) -> Any:
        if body.get("stream"):
            return StreamingResponse(events(body, chat), media_type="text/event-stream")
        return completion(body, chat)

    # typed bodies, validated by pydantic, as an OpenAI server's FastAPI layer does
    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest) -> Any:
        return await generate(req.model_dump(), chat=False)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(req: ChatRequest) -> Any:
        return await generate(req.model_dump(), chat=True)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> JSONResponse:
        body = await request.json()
        text = body.get("prompt") or json.dumps(body.get("messages", ""))
        tokens = list(range(max(1, len(str(text)) // 4)))
        return JSONResponse(
            {"count": len(tokens), "max_model_len": 4096, "tokens": tokens, "token_strs": None}
        )

    @app.get("/health")
    async def health() -> PlainTextResponse:
        return PlainTextResponse("")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = {
            "id": model,
            "object": "model",
            "created": 0,
            "owned_by": "fake",
            "root": model,
            "parent": None,
            "max_model_len": 4096,
        }
        return JSONResponse({"object": "list", "data": [card]})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse("", media_type="text/plain; version=0.0.4")

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info() -> JSONResponse:
        return JSONResponse({"model_path": model, "served_model_name": model})

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info() -> JSONResponse:
        return JSONResponse({"model_path": model, "is_generation": True})

    return app


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--port", type=int, default=0, help="0: a free port")
    ap.add_argument("--name", default="b0")
    ap.add_argument("--model", default="fake-model")
    args = ap.parse_args()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", args.port))
    sock.listen(2048)  # connections queue from now on; uvicorn accepts them
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        build_app(args.name, args.model),
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
    )
    server = uvicorn.Server(config)
    print(json.dumps({"url": f"http://127.0.0.1:{port}"}), flush=True)
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
