"""`kvroute index`: a standalone KV-event indexer writing into Redis.

It runs pod discovery and the KV-event subscriber, applying every batch to a
:class:`~scoring.index.redis.RedisIndex` that any number of ``kvroute serve --redis
URL`` replicas read.  It serves no API: only ``GET /metrics`` (the ``kvroute_event_*``
counters) and ``GET /health`` on a small port.

Usage::

    kvroute index --redis redis://redis:6379/0 [--config FILE] \\
        [--metrics-host 0.0.0.0] [--metrics-port 9100] [--sweep-interval 300] \\
        [any `kvroute serve` setting flag]

Settings come from the same model as ``kvroute serve`` (``--config`` YAML,
``KVROUTE_*`` env, flags): ``discovery``, ``events``, ``redis_namespace``.  The
index namespace must equal the routers' ``redis_namespace``.

Model name per pod (it seeds the block keys, so it must match what the routers use):
the topic ``kv@<pod>@<model>``, else the pod's first configured model, else
``events.model_fallback``.

Hot standby: one process writes a namespace, the holder of its writer lease
(:mod:`router.indexer.lease`).  A second `kvroute index` on the namespace (a second
replica) runs discovery and its ``/metrics`` but subscribes to no events until the
lease is free (the writer stopped, or died and its lease expired after
``--lease-seconds``, default 15); then it joins every pod (replaying what the pods'
replay buffers hold) and writes.  A writer that finds its lease taken by another process
(it stalled for longer than the lease) stops and exits with status 3, to come back as a
standby.  ``/health`` says ``role``: ``active`` or ``standby``.

Pod facts: the active indexer scrapes each pod's ``/metrics`` (``scrape.*`` settings)
for ``vllm:cache_config_info`` (``num_gpu_blocks``, ``block_size``): batches that
contradict them are rejected (:mod:`router.events.guard`).

Sweep: the indexer is the process that writes the index, so it also runs
:meth:`~scoring.index.redis.RedisIndex.sweep_forever` every ``--sweep-interval``
seconds (default 300; 0 turns it off): a cleared or vanished pod's retired slot ids
are deleted from the blocks' holder hints instead of waiting for the keys' TTL.
``/health`` reports ``swept`` (hint entries removed) and ``sweep_errors``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import socket
import sys
from collections.abc import Sequence
from typing import Any

import uvicorn
from fastapi import FastAPI, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

from router.config import Settings
from router.events import IndexSink, KVEventSubscriber
from router.events.sink import make_sink as _make_sink
from router.fleet.discovery import build_discovery
from router.fleet.k8s import DiscoveryError
from router.fleet.pods import PodRegistry, PodSpec
from router.fleet.scrape import MetricsScraper
from router.fleet.tls import PodTLS, make_client
from router.fleet.transport import PodTransport
from router.indexer.lease import LEASE_S, WriterLease
from router.metrics import register_build_info
from router.preflight import StartupError, load_settings
from router.shared_state import count_errors, make_guard

log = logging.getLogger(__name__)


def make_sink(index: Any, settings: Settings) -> IndexSink:
    """``scoring.events``' decoder + applier bound to ``index`` (engine-hash mode: see
    :func:`router.events.sink.make_sink`)."""
    return _make_sink(index, settings)


#: default seconds between two sweeps of retired slot ids (``--sweep-interval``)
#: how often the writer checks that Redis still holds its index (the namespace epoch)
EPOCH_CHECK_S = 5.0
DEFAULT_SWEEP_INTERVAL_S = 300.0
#: exit status of an indexer whose writer lease another process took
EXIT_LEASE_LOST = 3


class Indexer:
    """Discovery + subscriber + RedisIndex + a /metrics, /health server + the index
    sweep, in one loop.  ``sweep_interval_s`` <= 0 runs no sweep.  The subscriber and
    the sweep start once this process holds the namespace's writer lease (at once
    when nobody else does)."""

    def __init__(
        self,
        settings: Settings,
        redis_url: str,
        *,
        metrics_host: str = "127.0.0.1",
        metrics_port: int = 9100,
        sweep_interval_s: float = DEFAULT_SWEEP_INTERVAL_S,
        lease_s: float = LEASE_S,
    ) -> None:
        from scoring.index.redis import RedisIndex

        self.settings = settings
        self.sweep_interval_s = sweep_interval_s
        self.metrics = CollectorRegistry()
        register_build_info(self.metrics, "index")
        self.registry = PodRegistry()
        #: the guarded client (deadlines, breaker); its errors are exported here
        self.redis = make_guard(settings.model_copy(update={"redis_url": redis_url}))
        count_errors(self.redis, self.metrics)
        self.index = RedisIndex(self.redis, namespace=settings.redis_namespace, owns_client=True)
        self.sink = make_sink(self.index, settings)
        self.lease = WriterLease(self.index, self.metrics, lease_s=lease_s, standby=True)
        tls = PodTLS.from_settings(settings.proxy)
        self.client = make_client(settings.proxy, PodTransport(settings.proxy.max_keepalive, tls))
        #: each pod's cache size and block size, for the subscriber's checks
        self.scraper = MetricsScraper(
            self.registry,
            self.client,
            interval_s=settings.scrape.interval_s,
            timeout_s=settings.scrape.timeout_s,
            stale_after_s=settings.scrape.stale_after_s,
        )
        self.registry.subscribe(self._on_pod)
        self.subscriber = KVEventSubscriber(
            settings.events,
            self.registry,
            self.sink,
            metrics_registry=self.metrics,
            pod_facts=self.scraper.cache_config,
        )
        self.discovery = build_discovery(settings.discovery)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((metrics_host, metrics_port))
        self.metrics_url = "http://{}:{}".format(*self._sock.getsockname()[:2])
        self._server = uvicorn.Server(
            uvicorn.Config(self._app(), log_level="warning", lifespan="off", access_log=False)
        )
        self._tasks: list[asyncio.Task[None]] = []
        self._sweep_task: asyncio.Task[None] | None = None
        self._lease_task: asyncio.Task[None] | None = None
        self._activate_task: asyncio.Task[None] | None = None
        self._epoch_task: asyncio.Task[None] | None = None
        #: times Redis was found to have lost the index (its epoch changed)
        self.data_losses = Counter(
            "kvroute_index_data_losses",
            "Times the writer found the Redis namespace's epoch changed or gone (the index "
            "was lost: a restart without persistence, a flush) and re-learned every pod",
            registry=self.metrics,
        )
        #: the subscriber runs (this process holds the lease and writes)
        self.active = False

    def _on_pod(self, name: str, spec: PodSpec | None) -> None:
        if spec is None:
            self.scraper.forget(name)
        elif self.active:
            self.scraper.trigger()

    def _app(self) -> FastAPI:
        app = FastAPI(title="kvroute index", docs_url=None, redoc_url=None, openapi_url=None)

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(self.metrics), media_type=CONTENT_TYPE_LATEST)

        @app.get("/health")
        async def health() -> dict[str, Any]:
            stats = self.subscriber.stats
            return {
                "status": "ok",
                "role": "active" if self.active else "standby",
                "writer": self.lease.holder if self.active else self.lease.waiting_for,
                "pods": sorted(p.name for p in self.registry.all()),
                "batches": stats.total("batches"),
                "events": stats.total("events"),
                "queue_depth": stats.queue_depth(),
                "swept": self.index.swept,
                "sweep_errors": self.index.sweep_errors,
            }

        return app

    async def start(self) -> None:
        """Discovery, the metrics server and the lease now; the subscriber and the sweep
        when the lease is this process's (:meth:`_activate`)."""
        self._tasks.append(asyncio.create_task(self.discovery.run(self.registry), name="discovery"))
        self._tasks.append(
            asyncio.create_task(self._server.serve(sockets=[self._sock]), name="metrics-http")
        )
        while not self._server.started:
            if self._tasks[-1].done():
                self._tasks[-1].result()  # raise the server's startup error
            await asyncio.sleep(0.01)
        self._lease_task = asyncio.create_task(self.lease.run(), name="writer-lease")
        self._activate_task = asyncio.create_task(self._activate(), name="activate")
        log.info(
            "kvroute index: Redis namespace %r; metrics on %s",
            self.settings.redis_namespace,
            self.metrics_url,
        )

    async def _activate(self) -> None:
        await self.lease.acquired.wait()
        if self.lease.lost.is_set():
            return
        with contextlib.suppress(Exception):  # the pods' facts before their first batch
            await self.scraper.scrape_all()
        self.scraper.start()
        await self.subscriber.start()
        self.active = True
        self._epoch_task = asyncio.create_task(self._watch_epoch(), name="index-epoch")
        if self.sweep_interval_s > 0:
            self._sweep_task = asyncio.create_task(
                self.index.sweep_forever(self.sweep_interval_s), name="index-sweep"
            )
        log.info("kvroute index: writing Redis namespace %r", self.settings.redis_namespace)

    async def _watch_epoch(self) -> None:
        """Every :data:`EPOCH_CHECK_S`: a namespace epoch that changed (or vanished and
        was made anew) means Redis lost the index — every pod is cleared and re-learned
        from its replay buffer (and, in the routers, from the requests routed to it)."""
        known: str | None = None
        while True:
            try:
                epoch = await self.index.ensure_epoch()
            except Exception as exc:  # Redis down: the breaker counts it; try again
                log.debug("kvroute index: epoch check failed: %s", exc)
            else:
                if known is not None and epoch != known:
                    n = self.subscriber.relearn_all("data_loss")
                    self.data_losses.inc()
                    log.warning(
                        "kvroute index: Redis lost namespace %r (epoch %s -> %s): "
                        "re-learning %d pods from their replay buffers",
                        self.settings.redis_namespace,
                        known,
                        epoch,
                        n,
                    )
                known = epoch
            await asyncio.sleep(EPOCH_CHECK_S)

    async def stop(self) -> None:
        self._server.should_exit = True
        self.active = False
        if self._epoch_task is not None:
            self._epoch_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._epoch_task
            self._epoch_task = None
        if self._activate_task is not None:
            self._activate_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._activate_task
            self._activate_task = None
        if self._sweep_task is not None:
            self._sweep_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweep_task
            self._sweep_task = None
        for task in self._tasks[:1]:  # discovery
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        await self.subscriber.stop()
        await self.scraper.stop()
        await self.client.aclose()
        if self._lease_task is not None:
            self._lease_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._lease_task
            self._lease_task = None
            await self.lease.release()
        await self.index.close()
        self._sock.close()


async def run(indexer: Indexer, stop: asyncio.Event) -> bool:
    """Run until ``stop`` is set, the metrics server exits (it handles SIGINT/SIGTERM)
    or another process takes the writer lease; -> whether the lease was lost."""
    await indexer.start()
    try:
        waiters = [asyncio.create_task(stop.wait()), asyncio.create_task(indexer.lease.lost.wait())]
        await asyncio.wait([*waiters, *indexer._tasks[1:]], return_when=asyncio.FIRST_COMPLETED)
        for w in waiters:
            w.cancel()
    finally:
        await indexer.stop()
    return indexer.lease.lost.is_set()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvroute index",
        description="Run a KV-event indexer writing into Redis (discovery + subscriber). "
        "Other flags (--config FILE, --events.mode bind, ...) are `kvroute serve` settings.",
        epilog="example: kvroute index --redis redis://valkey:6379/0 --config router.yaml "
        "(the same router.yaml as `kvroute serve`: its discovery finds the pods; "
        "`kvroute serve --help` shows every setting)",
    )
    p.add_argument("--redis", metavar="URL", help="Redis URL (else redis_url from the config)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="listen address of /metrics")
    p.add_argument("--metrics-port", type=int, default=9100, help="port of /metrics, /health")
    p.add_argument(
        "--sweep-interval",
        type=float,
        default=DEFAULT_SWEEP_INTERVAL_S,
        metavar="SECONDS",
        help="seconds between sweeps of cleared pods' ids from the index (0: no sweep)",
    )
    p.add_argument(
        "--lease-seconds",
        type=float,
        default=LEASE_S,
        metavar="SECONDS",
        help="the writer lease's lifetime: a standby takes over this long after the writer "
        "died (renewed every third of it)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args, rest = _parser().parse_known_args(list(argv or []))
    try:
        settings = load_settings(rest)
    except StartupError as exc:
        for line in str(exc).splitlines():
            print(f"kvroute index: {line}", file=sys.stderr, flush=True)
        return 2
    if args.sweep_interval < 0:
        print(
            f"kvroute index: --sweep-interval must be >= 0 seconds, got {args.sweep_interval:g}",
            file=sys.stderr,
            flush=True,
        )
        return 2
    if args.lease_seconds <= 0:
        print(
            f"kvroute index: --lease-seconds must be > 0, got {args.lease_seconds:g}",
            file=sys.stderr,
            flush=True,
        )
        return 2
    url = args.redis or settings.redis_url
    if not url:
        print(
            "kvroute index: a Redis URL is required (--redis URL or redis_url)",
            file=sys.stderr,
            flush=True,
        )
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    async def _main() -> bool:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        indexer = Indexer(
            settings,
            url,
            metrics_host=args.metrics_host,
            metrics_port=args.metrics_port,
            sweep_interval_s=args.sweep_interval,
            lease_s=args.lease_seconds,
        )
        return await run(indexer, stop)

    try:
        lost = asyncio.run(_main())
    except (DiscoveryError, OSError) as exc:  # cannot discover pods, port taken...
        print(f"kvroute index: {exc}", file=sys.stderr, flush=True)
        return 2
    if lost:
        print(
            "kvroute index: another process took the writer lease; exiting to restart as a standby",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_LEASE_LOST
    return 0
