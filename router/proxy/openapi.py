"""``GET /openapi.json``: an OpenAPI 3.1 document of the router's own endpoints.

FastAPI describes the routes it serves (``/v1/models``, ``/v1/route``, ``/health``...),
but the generation endpoints are answered by the fast path in :mod:`router.proxy.app`
before FastAPI's routing, with no declared body; this module adds them (and the
configured passthrough paths) with request bodies described as far as the router reads
them: the OpenAI fields a client (or a fuzzer) needs — ``model``, ``messages`` /
``prompt`` / ``input``, ``stream``, ``max_tokens``... —, everything else allowed and
relayed to the pod as it is.  The models the fleet serves right now are the ``model``
field's examples.  The body models here document; they validate nothing (the decision
core checks what it reads, the pod the rest).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ImagePart(_Body):
    type: Literal["image_url"]
    image_url: dict[str, Any]


class ChatMessage(_Body):
    role: str = Field(description="system, user, assistant, tool, developer...")
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None


class StreamOptions(_Body):
    include_usage: bool = False


class _Generation(_Body):
    model: str = Field(description="a model (or LoRA adapter) the fleet serves")
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = Field(default=None, description="also a session id for `session`")
    cache_salt: str | None = Field(default=None, description="vLLM's prefix-cache salt")


class ChatCompletionRequest(_Generation):
    """``POST /v1/chat/completions`` (OpenAI / vLLM); routed on the rendered prompt."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_Generation):
    """``POST /v1/completions``: a prompt as text, texts, token ids or lists of them."""

    prompt: str | list[str] | list[int] | list[list[int]]


class EmbeddingRequest(_Body):
    """``POST /v1/embeddings``: routed to the least-loaded pod serving ``model``."""

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] | None = None


class ResponsesRequest(_Body):
    """``POST /v1/responses``: a follow-up naming ``previous_response_id`` goes to the
    pod that stored it."""

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    stream: bool = False
    store: bool | None = None
    background: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)


class RouteRequest(_Body):
    """``POST /v1/route``: a chat (``messages``), completion (``prompt``) or Responses
    (``input``) body; answered with where it would go and why, nothing is sent."""

    model: str
    messages: list[ChatMessage] | None = None
    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    input: str | list[dict[str, Any]] | None = None


class PassthroughRequest(_Body):
    """A pod endpoint relayed as it is (``proxy.passthrough_paths``) to the least-loaded
    pod serving ``model`` (which may be left out when one model is served)."""

    model: str | None = None


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error the router answers (OpenAI's shape; ``code`` is the reason counted
    in ``kvroute_bad_requests_total`` / ``kvroute_upstream_errors_total``)."""

    error: ErrorDetail


#: the fast-path endpoints: path -> (body model, summary)
GENERATION: dict[str, tuple[type[BaseModel], str]] = {
    "/v1/chat/completions": (ChatCompletionRequest, "Chat completion, routed cache-aware"),
    "/v1/completions": (CompletionRequest, "Completion, routed cache-aware"),
    "/v1/embeddings": (EmbeddingRequest, "Embeddings, least loaded"),
    "/v1/responses": (ResponsesRequest, "Responses API (stored responses stay on their pod)"),
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _add_schema(schemas: dict[str, Any], model: type[BaseModel]) -> dict[str, str]:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(schema.pop("$defs", {}))
    schemas[model.__name__] = schema
    return _ref(model.__name__)


def _errors(*statuses: int) -> dict[str, Any]:
    described = {
        400: "invalid body (not JSON, nested too deep, bad messages / prompt...)",
        401: "router API key missing or wrong",
        404: "no pod serves the model",
        408: "the request head or body did not arrive in time",
        413: "body over proxy.max_body_bytes",
        431: "request head over proxy.max_header_bytes / proxy.max_headers",
        502: "the pod failed (connect, transport, ejected while waiting)",
        503: "no healthy pod serves the model",
        504: "the pod did not answer in time",
    }
    content = {"application/json": {"schema": _ref("ErrorResponse")}}
    return {str(s): {"description": described[s], "content": content} for s in statuses}


def _relayed(summary: str) -> dict[str, Any]:
    return {
        "description": summary + "; the pod's answer as it is (JSON, or SSE with stream)",
        "content": {
            "application/json": {"schema": {"type": "object"}},
            "text/event-stream": {"schema": {"type": "string"}},
        },
    }


def _set_model_examples(schemas: dict[str, Any], models: list[str]) -> None:
    if not models:
        return
    for schema in schemas.values():
        field = schema.get("properties", {}).get("model")
        if isinstance(field, dict):
            field["examples"] = list(models)


def openapi_document(
    routes: Iterable[Any],
    *,
    version: str,
    passthrough_paths: Iterable[str],
    served_models: Iterable[str] = (),
) -> dict[str, Any]:
    """The document of ``GET /openapi.json`` (FastAPI's for ``routes`` plus the fast
    path's endpoints and the passthrough paths)."""
    api_routes = [r for r in routes if isinstance(r, APIRoute) and r.path != "/openapi.json"]
    doc = get_openapi(
        title="kvroute",
        version=version,
        description="Cache-aware router for vLLM pods: the OpenAI endpoints it serves "
        "and its own (route explanation, health, readiness, metrics).",
        routes=api_routes,
    )
    paths: dict[str, Any] = doc.setdefault("paths", {})
    schemas: dict[str, Any] = doc.setdefault("components", {}).setdefault("schemas", {})
    _add_schema(schemas, ErrorResponse)
    common = (400, 401, 404, 408, 413, 431, 502, 503, 504)
    for path, (model, summary) in GENERATION.items():
        ref = _add_schema(schemas, model)
        paths.setdefault(path, {})["post"] = {
            "summary": summary,
            "operationId": "post_" + path.strip("/").replace("/", "_"),
            "requestBody": {"required": True, "content": {"application/json": {"schema": ref}}},
            "responses": {"200": _relayed(summary), **_errors(*common)},
        }
    ref = _add_schema(schemas, RouteRequest)
    route_op = paths.setdefault("/v1/route", {}).setdefault("post", {})
    route_op["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref}}}
    route_op.setdefault("responses", {}).update(_errors(400, 401, 404, 408, 413, 431, 503))
    ref = _add_schema(schemas, PassthroughRequest)
    for path in passthrough_paths:
        paths.setdefault(path, {})["post"] = {
            "summary": f"{path}: relayed to the least-loaded pod serving the model",
            "operationId": "post_" + path.strip("/").replace("/", "_"),
            "requestBody": {"required": True, "content": {"application/json": {"schema": ref}}},
            "responses": {"200": _relayed(path), **_errors(*common)},
        }
    _set_model_examples(schemas, sorted(served_models))
    return doc
