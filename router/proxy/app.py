"""The FastAPI app of `kvroute serve`: :func:`create_app` builds it from :class:`Settings`.

All state lives in one :class:`~router.proxy.gateway.Gateway` (a
:class:`~router.core.RouterCore` with the proxy), created by the app's lifespan and
reachable as ``app.state.gateway``; the lifespan starts and stops it.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming or not),
``POST /v1/embeddings``, ``POST /v1/responses`` with ``GET /v1/responses/{id}`` and
``POST /v1/responses/{id}/cancel`` (sent to the pod that created the response, see
:mod:`router.decision.responses`), ``GET /v1/models``, ``POST /v1/route`` (explain, no forwarding),
``GET /health``, ``GET /ready``, ``GET /metrics``, ``GET /openapi.json`` (the fast path's
endpoints included, :mod:`router.proxy.openapi`); and ``proxy.passthrough_paths``
(``/tokenize``, ``/rerank``...: least-loaded pod serving the body's model).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from router.config import Settings
from router.decision.explain import explain
from router.decision.request import Kind, parse_body
from router.errors import RouterError, json_response
from router.logs import RateLimitedLog
from router.metrics import CONTENT_TYPE, kvroute_version
from router.proxy.access_log import Entry
from router.proxy.gateway import Gateway
from router.proxy.openapi import openapi_document
from router.proxy.protocol import ClientLimits
from router.tenants.auth import TenantContext

log = logging.getLogger(__name__)
_perf = time.perf_counter


# -- the app ---------------------------------------------------------------------------


def create_app(settings: Settings | None = None) -> FastAPI:
    """The router app; its lifespan owns a :class:`Gateway` (``app.state.gateway``)."""
    settings = settings or Settings()
    limited = RateLimitedLog(log)

    @asynccontextmanager
    async def lifespan(fastapi_app: FastAPI) -> AsyncIterator[None]:
        gateway = Gateway(settings)
        fastapi_app.state.gateway = app.gateway = gateway
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    app = _GatewayApp(
        title="kvroute",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )

    def gw(request: Request) -> Gateway:
        g: Gateway = request.app.state.gateway
        return g

    @app.exception_handler(RouterError)
    async def _router_error(request: Request, exc: RouterError) -> Response:
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return RouterError(exc.status_code, str(exc.detail), reason="http").response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        return RouterError(400, str(exc), reason="invalid_request").response()

    async def _generate(
        g: Gateway,
        ctx: TenantContext | None,
        kind: Kind,
        path: str,
        headers: Mapping[str, str],
        raw_headers: list[tuple[bytes, bytes]],
        receive: Receive,
        entry: Entry | None = None,
    ) -> Response:
        started = _perf()
        if g._api_keys:
            g.check_api_key(headers)
        raw = await g.receive_body(headers, receive)
        try:
            body = parse_body(raw, g.max_json_depth)
            if ctx is not None:  # the model check, the request bucket, the cache salt
                raw = await g.tenants.admit(
                    ctx, kind, body, raw, g.registry.served_models(), ask_usage=True
                )
        except RouterError as err:
            raise g.router.reject(err) from None
        tenant = ctx.name if ctx is not None else None
        routed = await g.router.decide(kind, body, headers, tenant=tenant)
        if entry is not None:
            entry.routed = routed
        if ctx is not None:
            try:
                await g.tenants.admit_tokens(ctx, routed.route.prompt_tokens)
            except RouterError as err:
                raise g.router.reject(err) from None
        if routed.pd is not None:  # a model whose pods have P/D roles
            return await g.disagg.forward(routed, path, raw, raw_headers, receive, started)
        # the client's bytes are forwarded, never re-serialised (a tenant's salt is
        # spliced in by router.rewrite)
        return await g.proxy.forward(routed, path, raw, raw_headers, receive, started)

    async def _serve(
        g: Gateway,
        kind: Kind,
        path: str,
        headers: Mapping[str, str],
        raw_headers: list[tuple[bytes, bytes]],
        receive: Receive,
        client: Any,
        entry: Entry | None = None,
    ) -> Response:
        """:func:`_generate` with the tenant identified first, errors as the tenant may
        see them, and the outcome counted per tenant."""
        gate = g.tenants
        if not gate.enabled:
            return await _generate(g, None, kind, path, headers, raw_headers, receive, entry)
        try:
            ctx = gate.identify(headers, client)
        except RouterError as err:
            return g.router.reject(err).response()
        try:
            response = await _generate(g, ctx, kind, path, headers, raw_headers, receive, entry)
        except RouterError as err:
            response = gate.public(err, ctx).response()
        gate.count(ctx, response.status_code)
        return gate.facing(response, g.pod_header_b)

    async def _fast(scope: Scope, receive: Receive, send: Send, kind: Kind, path: str) -> None:
        """The generation endpoints straight on ASGI: no Request object, no routing
        table, no dependency solving; headers as one plain dict (names are lowercase
        in ASGI; a repeated header keeps its last value)."""
        raw_headers: list[tuple[bytes, bytes]] = scope["headers"]
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in raw_headers}
        g = app.gateway
        entry = g.access_log.begin(scope, _perf())  # None: not logged
        try:
            if g.tenants.enabled:
                response = await _serve(
                    g, kind, path, headers, raw_headers, receive, scope.get("client"), entry
                )
            else:  # what _serve does without tenants, one coroutine less
                response = await _generate(
                    g, None, kind, path, headers, raw_headers, receive, entry
                )
        except RouterError as err:
            response = err.response()
        except Exception as exc:
            # a bug: the traceback once per exception type per 10 s, not once a request
            limited.exception(type(exc).__name__, "request failed")
            response = RouterError(500, "internal router error", reason="internal").response()
        if entry is None:
            await response(scope, receive, send)
            return
        try:
            await response(scope, receive, entry.watch(send))
        except BaseException as exc:
            entry.end(exc)
            raise
        entry.end()

    def _count_refused(reason: str) -> None:
        g = getattr(app, "gateway", None)
        if g is not None:
            g.metrics.child(g.metrics.bad_requests, reason).inc()

    p = settings.proxy
    app.client_limits = ClientLimits(
        max_header_bytes=p.max_header_bytes,
        max_headers=p.max_headers,
        keepalive_timeout_s=p.client_keepalive_timeout_s,
        header_timeout_s=p.client_header_timeout_s,
        body_timeout_s=p.client_body_timeout_s,
        on_reject=_count_refused,
    )
    app.fast_routes = dict(_FAST_KINDS)
    app.fast_routes.update((p, "passthrough") for p in settings.proxy.passthrough_paths)
    app.fast_handler = _fast

    async def _routed(request: Request, kind: Kind, path: str) -> Response:
        return await _serve(
            gw(request),
            kind,
            path,
            request.headers,
            request.headers.raw,
            request.receive,
            request.scope.get("client"),
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await _routed(request, "chat", "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _routed(request, "completion", "/v1/completions")

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await _routed(request, "embedding", "/v1/embeddings")

    async def _to_owner(request: Request, response_id: str, method: bytes) -> Response:
        g = gw(request)
        gate = g.tenants
        g.check_api_key(request.headers)
        ctx = gate.identify(request.headers, request.scope.get("client"))
        try:
            body = await g.read_body(request) if method == b"POST" else b""
            # another tenant's response is not found, exactly like an unknown id
            pod = await g.router.owner_of(response_id, ctx.name if ctx is not None else None)
            target = request.scope.get("raw_path") or request.url.path.encode()
            query = request.scope.get("query_string") or b""
            path = (target + (b"?" + query if query else b"")).decode("latin-1")
            response = await g.proxy.relay(pod, method, path, request.headers.raw, body)
        except RouterError as err:
            response = gate.public(err, ctx).response()
        gate.count(ctx, response.status_code)
        return gate.facing(response, g.pod_header_b)

    @app.get("/v1/responses/{response_id}")
    async def get_response(request: Request, response_id: str) -> Response:
        """A stored response (``?stream=true``: its events), from the pod holding it."""
        return await _to_owner(request, response_id, b"GET")

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(request: Request, response_id: str) -> Response:
        """Cancel a background response on the pod running it."""
        return await _to_owner(request, response_id, b"POST")

    @app.post("/v1/route")
    async def route(request: Request) -> Response:
        """Explain where a chat (``messages``), completion (``prompt``) or Responses
        (``input``) body would go."""
        g = gw(request)
        g.tenants.introspect(settings.security.route_endpoint, request.headers)
        if not g.tenants.tenancy.guarded:
            g.check_api_key(request.headers)
        raw = await g.read_body(request)
        try:
            body = parse_body(raw, g.max_json_depth)
        except RouterError as err:
            raise g.router.reject(err) from None
        # ?tenant=NAME: explain the body as that tenant's (its cache salt)
        as_tenant = g.tenants.tenancy.context(request.query_params.get("tenant", ""))
        if as_tenant is not None:
            body["cache_salt"] = as_tenant.salt
        kind: Kind = "chat" if "messages" in body or "prompt" not in body else "completion"
        if "input" in body and "messages" not in body and "prompt" not in body:
            kind = "responses"
        routed = await g.router.decide(kind, body, request.headers)
        return json_response(explain(routed, g.registry, g.settings.policy))

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        g = gw(request)
        g.check_api_key(request.headers)
        ctx = g.tenants.identify(request.headers, request.scope.get("client"))
        data = []
        for model in sorted(g.registry.served_models()):
            if ctx is not None and not ctx.allows(model):
                continue
            pods = [p.name for p in g.registry.candidates(model)]
            entry: dict[str, Any] = {
                "id": model,
                "object": "model",
                "created": 0,
                "owned_by": "kvroute",
                "root": g.scraper.parents.get(model, model),
                "parent": g.scraper.parents.get(model),
            }
            max_len = g.scraper.model_max_len(model, pods)
            if max_len:
                entry["max_model_len"] = max_len
            data.append(entry)
        return json_response({"object": "list", "data": data})

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request) -> Response:
        """This API's OpenAPI document, the fast path's endpoints included."""
        g = gw(request)
        g.tenants.introspect(settings.security.openapi_endpoint, request.headers)
        return json_response(
            openapi_document(
                app.routes,
                version=kvroute_version(),
                passthrough_paths=settings.proxy.passthrough_paths,
                served_models=g.registry.served_models(),
            )
        )

    @app.get("/health")
    async def health() -> Response:
        return json_response({"status": "ok"})

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        g = gw(request)
        ok, per_model = g.ready()
        status = 200 if ok else 503
        if g.tenants.tenancy.guarded and not g.tenants.tenancy.is_admin(request.headers):
            return json_response({"ready": ok}, status=status)  # no model names to tenants
        return json_response({"ready": ok, "healthy_pods": per_model}, status=status)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        g = gw(request)
        g.tenants.introspect(settings.security.metrics_endpoint, request.headers)
        shared = g.shared_metrics
        body = g.metrics.render() if shared is None else shared.render_all()
        return Response(body, media_type=CONTENT_TYPE)

    return app


_FAST_KINDS: tuple[tuple[str, Kind], ...] = (
    ("/v1/chat/completions", "chat"),
    ("/v1/completions", "completion"),
    ("/v1/embeddings", "embedding"),
    ("/v1/responses", "responses"),
)


class _GatewayApp(FastAPI):
    """FastAPI with a fast path: ``POST`` to the generation endpoints skips the
    middleware stack and dependency solving (a proxy's per-request CPU is its latency
    and its throughput); errors are still OpenAI JSON.  Everything else is FastAPI."""

    #: path -> kind of the fast-path endpoints, and their handler
    fast_routes: dict[str, Kind] = {}
    fast_handler: Callable[[Scope, Receive, Send, Kind, str], Awaitable[None]]
    #: the lifespan's gateway (also ``state.gateway``), a plain attribute for the fast path
    gateway: Gateway
    #: what a client connection may do, read by the HTTP protocol (router.proxy.protocol)
    client_limits: ClientLimits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path = scope["path"]
            kind = self.fast_routes.get(path)
            if kind is not None:
                scope["app"] = self
                await self.fast_handler(scope, receive, send, kind, path)
                return
        await super().__call__(scope, receive, send)


def app_from_env() -> FastAPI:
    """Factory for uvicorn workers: settings passed by `kvroute serve` as JSON in
    ``KVROUTE_SERVE_SETTINGS_JSON`` (workers are separate processes)."""
    import os

    raw = os.environ.get("KVROUTE_SERVE_SETTINGS_JSON")
    settings = Settings.model_validate_json(raw) if raw else Settings.load([])
    app = create_app(settings)
    # a worker process: what is loaded by now lives as long as the process, so move it
    # out of the collector's sight, and collect the young generation less often (the
    # hot path allocates a few hundred short-lived objects a request)
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)
    return app


#: gc thresholds of a `kvroute serve` worker (CPython's default: 700, 10, 10)
GC_THRESHOLDS = (10_000, 20, 20)
