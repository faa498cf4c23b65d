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

This module wires the routes; the parts live beside it: :mod:`router.sim.parsing` (the
request), :mod:`router.sim.execution` (generation and the P/D transfer),
:mod:`router.sim.completions` and :mod:`router.sim.responses_api` (the answers),
:mod:`router.sim.wire` (errors, SSE framing, the version).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from router.sim.completions import chat_completion_json, completion_json, stream_answer
from router.sim.disagg import READ_PATH, SimDisagg
from router.sim.embeddings import embedding_vector
from router.sim.engine import SimEngine
from router.sim.execution import Execution
from router.sim.hashing import lora_path
from router.sim.parsing import RequestParser
from router.sim.responses_api import ResponsesAPI, StoredResponse
from router.sim.settings import SimSettings
from router.sim.wire import VLLM_VERSION, APIError, ClientDisconnected
from router.tokenize import PromptTokenizer

__all__ = [
    "VLLM_VERSION",
    "APIError",
    "ClientDisconnected",
    "SimAPI",
    "StoredResponse",
    "build_app",
]


class SimAPI:
    """The endpoints of one pod: parsing, running and answering each request."""

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
        self.parse = RequestParser(settings, engine, tokenizer)
        self.execution = Execution(engine, self.pd)
        self.responses_api = ResponsesAPI(settings, engine, tokenizer, self.parse, self.execution)

    async def completions(self, request: Request) -> Response:
        body = await self.parse.body(request)
        self.parse.lora(body)
        if "prompt" not in body:
            raise APIError("prompt is required", param="prompt")
        req = self.parse.generation(body, self.parse.prompt_ids(body["prompt"]))
        stream, usage = self.parse.stream_flags(body)
        pd = await self.execution.disagg(body, request, req)
        rid = f"cmpl-{uuid.uuid4().hex[:16]}"
        model = body.get("model") or self.settings.model
        created = int(time.time())
        if stream:
            return stream_answer(self.engine, req, rid, model, created, usage, chat=False)
        await self.execution.run(req, request)
        return self.execution.answer(completion_json(req, rid, model, created), pd, req)

    async def chat_completions(self, request: Request) -> Response:
        body = await self.parse.body(request)
        self.parse.lora(body)
        req = self.parse.generation(body, self.parse.chat_ids(body))
        stream, usage = self.parse.stream_flags(body)
        pd = await self.execution.disagg(body, request, req)
        rid = f"chatcmpl-{uuid.uuid4().hex[:16]}"
        model = body.get("model") or self.settings.model
        created = int(time.time())
        if stream:
            return stream_answer(self.engine, req, rid, model, created, usage, chat=True)
        await self.execution.run(req, request)
        out = chat_completion_json(req, rid, model, created)
        return self.execution.answer(out, pd, req)

    async def embeddings(self, request: Request) -> Response:
        body = await self.parse.body(request)
        self.parse.lora(body)
        inp = body.get("input")
        items: list[Any] = (
            inp if isinstance(inp, list) and inp and not isinstance(inp[0], int) else [inp]
        )
        vectors, total = [], 0
        for i, item in enumerate(items):
            if item is None:
                raise APIError("input is required", param="input")
            try:
                ids = self.parse.prompt_ids(item)
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
            vector = embedding_vector(ids, self.settings.embedding_dim)
            vectors.append({"index": i, "object": "embedding", "embedding": vector})
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

    async def tokenize(self, request: Request) -> Response:
        body = await self.parse.body(request)
        self.parse.lora(body)
        if "messages" in body:
            ids = self.parse.chat_ids(body)
        elif "prompt" in body:
            if not isinstance(body["prompt"], str):
                raise APIError("prompt must be a string", param="prompt")
            ids = self.parse.prompt_ids(body["prompt"])
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
    app.add_api_route("/v1/responses", api.responses_api.create, methods=["POST"])
    app.add_api_route(READ_PATH, api.pd.read_endpoint, methods=["POST"])

    @app.get("/v1/responses/{response_id}")
    async def _get_response(response_id: str) -> JSONResponse:
        return api.responses_api.get(response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def _cancel_response(response_id: str) -> JSONResponse:
        return api.responses_api.cancel(response_id)

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
