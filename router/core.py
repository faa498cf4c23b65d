"""Everything a front needs to decide where a request goes, assembled once per process.

:class:`RouterCore` owns the fleet (registry, discovery, health checks, scraped load),
the index and the KV-event subscriber feeding it, the router-tracked load, the policy,
the tokenizers and the decision core (:class:`~router.decision.core.RequestRouter`).
A front adds only its protocol: the proxy front (:class:`router.proxy.gateway.Gateway`,
`kvroute serve`) forwards the request itself.  Nothing here is a module global, so
several cores (tests, workers) can live in one process.

:meth:`RouterCore.start` starts, in order: discovery, a first health round (to learn
which models the pods serve), the KV-event subscriber (with ``redis_url`` only when
``index_writer``: by default a separate `kvroute index` writes), the metrics scraper,
the index-entries gauge and the writer lease; :meth:`RouterCore.stop` stops them in
reverse order.  The :class:`~router.decision.learning.RouteLearner` (speculative
entries) hears the sink's events, the scraper's samples, the index-gauge loop's counts
and the fleet's departures; a front tells it what it sends (``RequestRouter.sent``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from typing import Any

import httpx

from router.config import Settings
from router.decision.core import RequestRouter
from router.decision.learning import RouteLearner
from router.decision.owners import MemoryOwnerStore, OwnerStore, RedisOwnerStore
from router.events import KVEventSubscriber
from router.fleet.discovery import build_discovery
from router.fleet.first_tokens import FirstTokenLedger
from router.fleet.health import HealthChecker
from router.fleet.load import LoadStore, MemoryLoadStore, PendingLoad
from router.fleet.pods import PodRegistry, PodSpec
from router.fleet.scrape import MetricsScraper, Scraped
from router.fleet.tls import PodTLS, make_client
from router.fleet.transport import PodTransport
from router.indexer.lease import WriterLease
from router.metrics import RouterMetrics, policy_families, register_build_info
from router.metrics_share import SharedMetrics
from router.shared_state import count_errors, make_guard
from router.tokenize import PromptTokenizer, load_tokenizer
from scoring.index.base import BlockIndex
from scoring.index.redis_guard import RedisGuard
from scoring.policies import build_policy
from scoring.policies.base import Policy, reads_output

log = logging.getLogger(__name__)


class RouterCore:
    """What one router process owns, whatever its front."""

    def __init__(self, settings: Settings, component: str = "serve") -> None:
        self.settings = settings
        self.metrics = RouterMetrics()
        register_build_info(self.metrics.registry, component, settings.policy)
        self.registry = PodRegistry()
        self.policy: Policy = build_policy(settings.policy, settings.policy_params)
        #: the policy has an ``on_finished`` of its own (else the fronts skip the no-op)
        self.policy_reads_output = reads_output(self.policy)
        self.metrics.add_collector(
            lambda: policy_families(
                self.policy.name,
                self.policy.learned(),
                self.policy.rejected_observations(),
                self.policy.learned_per_pod(),
            )
        )
        self._tokenizers: dict[str, PromptTokenizer] = {}
        #: the one TLS context for https pods (requests, scrapes, health checks)
        self.pod_tls = PodTLS.from_settings(settings.proxy)
        self.transport = PodTransport(settings.proxy.max_keepalive, self.pod_tls)
        self.client: httpx.AsyncClient = make_client(settings.proxy, self.transport)
        #: the one guarded Redis client (``redis_url``) the stores share
        self.redis = make_guard(settings) if settings.redis_url else None
        if self.redis is not None:
            count_errors(self.redis, self.metrics.registry)
        self.index: BlockIndex = _make_index(settings, self.redis)
        self.load: LoadStore = _make_load_store(settings, self.redis)
        #: speculative entries: pods learned from the requests routed to them where the
        #: KV events cannot tell (no events at all: in memory with events off)
        self.learner = RouteLearner(
            settings.speculative,
            events_off=not settings.events.enabled and settings.redis_url is None,
            tier=self.index.tiers[0],
        )
        self.scraper = MetricsScraper(
            self.registry,
            self.client,
            interval_s=settings.scrape.interval_s,
            timeout_s=settings.scrape.timeout_s,
            stale_after_s=settings.scrape.stale_after_s,
            on_error=lambda pod: self.metrics.scrape_errors.labels(pod).inc(),
            on_scraped=self._on_scraped,
        )
        #: requests whose first token is not seen here (JSON answers forwarded as they
        #: came), released by their pods' scraped counts (router/fleet/first_tokens.py)
        self.first_tokens = FirstTokenLedger(self.policy, self.metrics.unseen_first_tokens)
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
                pod_facts=self.scraper.cache_config,
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
            self.learner,
        )
        if self.learner.enabled:
            if self.sink is not None:
                self.sink.learner = self.learner
            self.metrics.add_collector(
                lambda: self.learner.collect(p.name for p in self.registry.all())
            )
        if self.sink is not None and self.sink.applier.hasher is not None:
            # engine-hash mode, and this process applies events: learn routed chains
            self.router.on_routed = self.sink.learn_later
            self.sink.lora_path_of = self.scraper.adapter_paths.get
        #: response id -> the pod that stored it (``/v1/responses``)
        self.owners: OwnerStore = _make_owner_store(settings, self.redis)
        self.router.owners = self.owners
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

    def _on_scraped(self, pod: str, scraped: Scraped) -> None:
        """A fresh scrape of ``pod``: the speculative entries' hit check, the first
        tokens it counted that were not seen here, and what the policy learns of it."""
        if self.learner.enabled:
            self.learner.on_scraped(pod, scraped)
        self.first_tokens.on_scraped(pod, scraped)
        self.policy.on_scraped(pod, scraped.counters)

    def _on_pod(self, name: str, spec: PodSpec | None) -> None:
        if spec is None:
            self.policy.on_pod_removed(name)
            self.first_tokens.forget(name)
            self.router.pd.on_pod_removed(name)
            self.learner.gone(name)
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
            await self.load.close()
        with contextlib.suppress(Exception):
            await self.index.close()
        with contextlib.suppress(Exception):
            await self.owners.close()
        if self.redis is not None:
            with contextlib.suppress(Exception):
                await self.redis.aclose()

    async def update_index_gauge(self) -> None:
        """``kvroute_index_entries`` per registered pod, 0 for one the index holds
        nothing for (cleared, resynced): a pod missing from ``pod_entries`` must not keep
        its old value.  Pods no longer registered get no series (``forget_pod``)."""
        entries = await self.index.pod_entries()
        self.router.views.resident = entries
        names = [state.name for state in self.registry.all()]
        for name in names:
            self.metrics.index_entries.labels(name).set(entries.get(name, 0))
        if self.learner.enabled:
            self.learner.index_entries(
                entries, names, self._capacity_blocks, shared=self.sink is None
            )

    async def _index_gauge_loop(self) -> None:
        while True:
            try:
                await self.update_index_gauge()
            except Exception as exc:
                log.debug("index entries gauge: %s", exc)
            await asyncio.sleep(max(self.settings.scrape.interval_s, 1.0))

    def _capacity_blocks(self, pod: str) -> int | None:
        scraped = self.scraper.get(pod)
        return scraped.capacity_blocks if scraped is not None else None


def _make_index(settings: Settings, redis: RedisGuard | None) -> BlockIndex:
    if redis is not None:
        from scoring.index.redis import RedisIndex

        return RedisIndex(redis, namespace=settings.redis_namespace)
    from scoring.index.memory import InMemoryIndex

    return InMemoryIndex(max_entries=settings.index_capacity)


def _make_load_store(settings: Settings, redis: RedisGuard | None) -> LoadStore:
    if redis is not None:
        from scoring.index.redis import RedisLoadStore

        return RedisLoadStore(redis, namespace=settings.redis_namespace)
    return MemoryLoadStore()


def _make_owner_store(settings: Settings, redis: RedisGuard | None) -> OwnerStore:
    r = settings.responses
    if redis is not None:
        return RedisOwnerStore(redis, settings.redis_namespace, r.owner_ttl_s, owns_client=False)
    return MemoryOwnerStore(r.max_owners, r.owner_ttl_s)


def _make_sink(index: BlockIndex, settings: Settings) -> Any:
    # router.events.IndexSink: also forgets departed pods in the applier and asks the
    # subscriber to resync a pod whose events the applier had to skip; engine-hash mode
    # (events.engine_hash_*) learns routed requests' chains to link orphans
    from router.events.sink import make_sink

    return make_sink(index, settings)
