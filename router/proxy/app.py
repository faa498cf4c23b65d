"""The FastAPI app of `kvroute serve`: :func:`create_app` builds it from :class:`Settings`.

All state lives in one :class:`Gateway`, created by the app's lifespan and reachable as
``app.state.gateway``; nothing is a module global, so several apps (tests, workers) can
live in one process.  The lifespan starts, in order: the pod registry and discovery, a
first health round (to learn which models the pods serve), the index (in memory, or
Redis with ``redis_url``) and the KV-event subscriber feeding it (with ``redis_url`` only
when ``index_writer``: by default a separate `kvroute index` writes), the load store, the
metrics scraper; it stops them in reverse order.

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming or not),
``POST /v1/embeddings``, ``POST /v1/responses`` with ``GET /v1/responses/{id}`` and
``POST /v1/responses/{id}/cancel`` (sent to the pod that created the response, see
:mod:`router.decision.responses`), ``GET /v1/models``, ``POST /v1/route`` (explain, no forwarding),
``GET /health``, ``GET /ready``, ``GET /metrics``; and ``proxy.passthrough_paths``
(``/tokenize``, ``/rerank``...: least-loaded pod serving the body's model).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hmac
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from router.config import Settings
from router.decision.core import Kind, RequestRouter, explain, parse_body
from router.decision.responses import MemoryOwnerStore, OwnerStore, RedisOwnerStore
from router.errors import RouterError, json_response
from router.events import KVEventSubscriber
from router.fleet.discovery import build_discovery
from router.fleet.health import HealthChecker
from router.fleet.load import LoadStore, MemoryLoadStore, MetricsScraper, PendingLoad
from router.fleet.pods import PodRegistry, PodSpec
from router.indexer.lease import WriterLease
from router.metrics import CONTENT_TYPE, RouterMetrics, register_build_info
from router.proxy.forward import PodTLS, PodTransport, Proxy, make_client
from router.proxy.metrics_share import SharedMetrics
from router.tokenize import PromptTokenizer, load_tokenizer
from scoring.index.base import BlockIndex
from scoring.policies import build_policy
from scoring.policies.base import Policy

log = logging.getLogger(__name__)
_perf = time.perf_counter


class Gateway:
    """Everything one router app owns."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.metrics = RouterMetrics()
        register_build_info(self.metrics.registry, "serve", settings.policy)
        self.registry = PodRegistry()
        self.policy: Policy = build_policy(settings.policy, settings.policy_params)
        self._tokenizers: dict[str, PromptTokenizer] = {}
        #: the one TLS context for https pods (requests, scrapes, health checks)
        self.pod_tls = PodTLS.from_settings(settings.proxy)
        self.transport = PodTransport(settings.proxy.max_keepalive, self.pod_tls)
        self.client: httpx.AsyncClient = make_client(settings.proxy, self.transport)
        self.index: BlockIndex = _make_index(settings)
        self.load: LoadStore = _make_load_store(settings)
        self.scraper = MetricsScraper(
            self.registry,
            self.client,
            interval_s=settings.scrape.interval_s,
            timeout_s=settings.scrape.timeout_s,
            stale_after_s=settings.scrape.stale_after_s,
            on_error=lambda pod: self.metrics.scrape_errors.labels(pod).inc(),
        )
        self.health = HealthChecker(
            self.registry,
            settings.health,
            metrics_registry=self.metrics.registry,
            tls=self.pod_tls.context,
        )
        self.pending = PendingLoad()
        self.subscriber: KVEventSubscriber | None = None
        self.sink: Any = None
        #: with Redis, a replica that applies KV events holds the namespace's writer lease
        self.lease: WriterLease | None = None
        if settings.events.enabled and (settings.redis_url is None or settings.index_writer):
            self.sink = _make_sink(self.index, settings)
            if settings.redis_url is not None:
                from scoring.index.redis import RedisIndex

                assert isinstance(self.index, RedisIndex)
                self.lease = WriterLease(self.index, self.metrics.registry)
            self.subscriber = KVEventSubscriber(
                settings.events,
                self.registry,
                self.sink,
                metrics_registry=self.metrics.registry,
            )
        self.router = RequestRouter(
            settings,
            self.registry,
            self.index,
            self.policy,
            self.load,
            self.scraper,
            self.tokenizer_for,
            self.metrics,
            self.pending,
        )
        if self.sink is not None and self.sink.applier.hasher is not None:
            # engine-hash mode, and this process applies events: learn routed chains
            self.router.on_routed = self.sink.learn_later
            self.sink.lora_path_of = self.scraper.adapter_paths.get
        self.proxy = Proxy(
            self.client,
            settings.proxy,
            self.registry,
            self.load,
            self.policy,
            self.metrics,
            policy_name=settings.policy,
            pod_header=settings.pod_header,
            forward_authorization=not settings.api_keys,
            pending=self.pending,
            transport=self.transport,
        )
        #: response id -> the pod that stored it (``/v1/responses``)
        self.owners: OwnerStore = _make_owner_store(settings)
        self.router.owners = self.proxy.owners = self.owners
        self._api_keys = [k.encode() for k in settings.api_keys]
        self._tasks: list[asyncio.Task[Any]] = []
        #: `kvroute serve --workers N`: every worker's metrics in one /metrics
        self.shared_metrics = SharedMetrics.from_env(self.metrics.render)
        self._running = False
        self.registry.subscribe(self._on_pod)

    # -- pieces ------------------------------------------------------------------------

    def tokenizer_for(self, model: str) -> PromptTokenizer:
        spec = self.settings.tokenizer_for(model)
        key = f"{spec}\x00{model}" if spec.startswith("remote:") else spec
        tok = self._tokenizers.get(key)
        if tok is None:
            tls = self.pod_tls.context  # remote:https://... pods: the pods' CA and checks
            tok = self._tokenizers[key] = load_tokenizer(spec, model=model, tls=tls)
        return tok

    def _on_pod(self, name: str, spec: PodSpec | None) -> None:
        if spec is None:
            self.policy.on_pod_removed(name)
            self.scraper.forget(name)
            self.metrics.forget_pod(name)
            self._spawn(self.load.clear_pod(name))
        else:
            self.scraper.trigger()
            state = self.registry.get(name)
            if self._running and self.settings.health.enabled and state is not None:
                # a pod discovered later: learn its models now, not at the next round
                self._spawn(self.health.check(state))

    def _spawn(self, coro: Awaitable[Any]) -> None:
        try:
            task = asyncio.ensure_future(coro)
        except RuntimeError:  # no running loop (registry changed outside the app)
            if asyncio.iscoroutine(coro):
                coro.close()
            return
        self._tasks.append(task)
        task.add_done_callback(lambda t: self._tasks.remove(t) if t in self._tasks else None)

    def check_api_key(self, headers: Mapping[str, str]) -> None:
        """401 unless router API keys are off or ``Authorization: Bearer <key>`` matches."""
        if not self._api_keys:
            return
        auth = headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and any(
            hmac.compare_digest(token.strip().encode(), k) for k in self._api_keys
        ):
            return
        raise self.router.reject(
            RouterError(
                401,
                "invalid or missing API key (send 'Authorization: Bearer <key>')",
                reason="unauthorized",
                type="authentication_error",
            )
        )

    def _too_big(self) -> RouterError:
        limit = self.settings.proxy.max_body_bytes
        return self.router.reject(
            RouterError(
                413,
                f"request body larger than {limit} bytes (proxy.max_body_bytes)",
                reason="body_too_large",
            )
        )

    async def read_body(self, request: Request) -> bytes:
        return await self.receive_body(request.headers, request.receive)

    async def receive_body(self, headers: Mapping[str, str], receive: Receive) -> bytes:
        """The request body from ASGI ``receive``; 413 past ``proxy.max_body_bytes``
        (at once when Content-Length says so)."""
        limit = self.settings.proxy.max_body_bytes
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise self._too_big()
        message = await receive()
        body: bytes = message.get("body", b"")
        if not message.get("more_body", False):  # the common case: one message
            if len(body) > limit:
                raise self._too_big()
            return body
        chunks = [body]
        size = len(body)
        while message.get("more_body", False):
            message = await receive()
            if message["type"] == "http.disconnect":
                raise RouterError(499, "client disconnected", reason="client_disconnected")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise self._too_big()
            chunks.append(chunk)
        return b"".join(chunks)

    def ready(self) -> tuple[bool, dict[str, int]]:
        """(ready, healthy pods per model): >= 1 healthy pod per configured model
        (every model seen on any pod when none is configured; at least one overall)."""
        pods = self.registry.all()
        models = list(self.settings.models) or sorted({m for p in pods for m in p.models})
        healthy = {m: sum(1 for p in pods if p.healthy and m in p.models) for m in models}
        ok = bool(models) and all(n > 0 for n in healthy.values())
        return ok, healthy

    # -- lifecycle ---------------------------------------------------------------------

    def _load_tokenizers(self) -> None:
        """Load every configured tokenizer now, so a bad spec fails the start loudly."""
        for model in [*self.settings.models, *self.settings.tokenizers]:
            self.tokenizer_for(model)
        if not self.settings.tokenizer.startswith("remote:"):
            self.tokenizer_for("")

    async def start(self) -> None:
        self._load_tokenizers()
        self._running = True
        discovery = build_discovery(self.settings.discovery)
        self._tasks.append(asyncio.create_task(discovery.run(self.registry), name="discovery"))
        await asyncio.sleep(0)  # static discovery fills the registry at once
        if self.settings.health.enabled:
            with contextlib.suppress(Exception):
                await self.health.check_all()
            self._tasks.append(asyncio.create_task(self.health.run(), name="health"))
        if self.subscriber is not None:
            await self.subscriber.start()
        if self.sink is not None:
            self.sink.start_learning()
        with contextlib.suppress(Exception):
            await self.scraper.scrape_all()
        self.scraper.start()
        self._tasks.append(asyncio.create_task(self._index_gauge_loop(), name="index-gauge"))
        if self.shared_metrics is not None:
            self._tasks.append(asyncio.create_task(self.shared_metrics.run(), name="metrics-share"))
        if self.lease is not None:
            self._tasks.append(asyncio.create_task(self.lease.run(), name="writer-lease"))

    async def stop(self) -> None:
        self._running = False
        await self.scraper.stop()
        if self.sink is not None:
            with contextlib.suppress(Exception):
                await self.sink.stop_learning()
        if self.subscriber is not None:
            with contextlib.suppress(Exception):
                await self.subscriber.stop()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        if self.shared_metrics is not None:
            self.shared_metrics.remove()
        if self.lease is not None:
            await self.lease.release()
        with contextlib.suppress(Exception):
            await self.health.aclose()
        await self.client.aclose()
        with contextlib.suppress(Exception):
            await self.proxy.aclose()
        with contextlib.suppress(Exception):
            await self.load.close()
        with contextlib.suppress(Exception):
            await self.index.close()
        with contextlib.suppress(Exception):
            await self.owners.close()

    async def _index_gauge_loop(self) -> None:
        while True:
            try:
                entries = await self.index.pod_entries()
                self.router.resident = entries
                for pod, n in entries.items():
                    self.metrics.index_entries.labels(pod).set(n)
            except Exception as exc:
                log.debug("index entries gauge: %s", exc)
            await asyncio.sleep(max(self.settings.scrape.interval_s, 1.0))


def _make_index(settings: Settings) -> BlockIndex:
    if settings.redis_url:
        from scoring.index.redis import RedisIndex

        return RedisIndex.from_url(settings.redis_url, namespace=settings.redis_namespace)
    from scoring.index.memory import InMemoryIndex

    return InMemoryIndex(max_entries=settings.index_capacity)


def _make_load_store(settings: Settings) -> LoadStore:
    if settings.redis_url:
        from scoring.index.redis import RedisLoadStore

        return RedisLoadStore.from_url(settings.redis_url, namespace=settings.redis_namespace)
    return MemoryLoadStore()


def _make_owner_store(settings: Settings) -> OwnerStore:
    r = settings.responses
    if settings.redis_url:
        return RedisOwnerStore.from_url(settings.redis_url, settings.redis_namespace, r.owner_ttl_s)
    return MemoryOwnerStore(r.max_owners, r.owner_ttl_s)


def _make_sink(index: BlockIndex, settings: Settings) -> Any:
    # router.events.IndexSink: also forgets departed pods in the applier and asks the
    # subscriber to resync a pod whose events the applier had to skip; engine-hash mode
    # (events.engine_hash_*) learns routed requests' chains to link orphans
    from router.events.sink import make_sink

    return make_sink(index, settings)


# -- the app ---------------------------------------------------------------------------


def create_app(settings: Settings | None = None) -> FastAPI:
    """The router app; its lifespan owns a :class:`Gateway` (``app.state.gateway``)."""
    settings = settings or Settings()

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
        kind: Kind,
        path: str,
        headers: Mapping[str, str],
        raw_headers: list[tuple[bytes, bytes]],
        receive: Receive,
    ) -> Response:
        started = _perf()
        if g._api_keys:
            g.check_api_key(headers)
        raw = await g.receive_body(headers, receive)
        try:
            body = parse_body(raw)
        except RouterError as err:
            raise g.router.reject(err) from None
        routed = await g.router.decide(kind, body, headers)
        # the original bytes are forwarded: the body is never re-serialised
        return await g.proxy.forward(routed, path, raw, raw_headers, receive, started)

    async def _fast(scope: Scope, receive: Receive, send: Send, kind: Kind, path: str) -> None:
        """The generation endpoints straight on ASGI: no Request object, no routing
        table, no dependency solving; headers as one plain dict (names are lowercase
        in ASGI; a repeated header keeps its last value)."""
        raw_headers: list[tuple[bytes, bytes]] = scope["headers"]
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in raw_headers}
        try:
            response = await _generate(app.gateway, kind, path, headers, raw_headers, receive)
        except RouterError as err:
            response = err.response()
        except Exception:
            log.exception("request failed")
            response = RouterError(500, "internal router error", reason="internal").response()
        await response(scope, receive, send)

    app.fast_routes = dict(_FAST_KINDS)
    app.fast_routes.update((p, "passthrough") for p in settings.proxy.passthrough_paths)
    app.fast_handler = _fast

    async def _routed(request: Request, kind: Kind, path: str) -> Response:
        return await _generate(
            gw(request), kind, path, request.headers, request.headers.raw, request.receive
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
        g.check_api_key(request.headers)
        body = await g.read_body(request) if method == b"POST" else b""
        pod = await g.router.owner_of(response_id)
        target = request.scope.get("raw_path") or request.url.path.encode()
        query = request.scope.get("query_string") or b""
        path = (target + (b"?" + query if query else b"")).decode("latin-1")
        return await g.proxy.relay(pod, method, path, request.headers.raw, body)

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
        g.check_api_key(request.headers)
        raw = await g.read_body(request)
        body = parse_body(raw)
        kind: Kind = "chat" if "messages" in body or "prompt" not in body else "completion"
        if "input" in body and "messages" not in body and "prompt" not in body:
            kind = "responses"
        routed = await g.router.decide(kind, body, request.headers)
        return json_response(explain(routed, g.registry, g.settings.policy))

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        g = gw(request)
        g.check_api_key(request.headers)
        data = []
        for model in sorted(g.registry.served_models()):
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

    @app.get("/health")
    async def health() -> Response:
        return json_response({"status": "ok"})

    @app.get("/ready")
    async def ready(request: Request) -> Response:
        ok, per_model = gw(request).ready()
        return json_response({"ready": ok, "healthy_pods": per_model}, status=200 if ok else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        g = gw(request)
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
