"""The KV-event subscriber: ZMQ sockets -> per-pod bounded queues -> index writer.

Tasks sharing one asyncio loop with the request path:

* **readers** (one per pod SUB socket in dial mode, one bound SUB socket in bind mode;
  :mod:`router.events.readers`) only receive ``[topic, seq, payload]`` messages, check
  their framing and sender, and append them to their pod's own bounded queue
  (:class:`~router.events.feed.PodFeed`): a full queue drops the batch (counted) and
  marks *that* pod for resync, so neither a slow index nor one pod's flood stalls the
  sockets or costs another pod its batches;
* **one writer** (:class:`~router.events.writer.EventWriter`, where the sequence
  semantics are) takes one batch per turn from each pod with work, tracks ``seq`` per
  pod, decodes the payload, checks it against the pod (:mod:`router.events.guard`) and
  applies it to the index through an :class:`EventSink`;
* **replay tasks**, one per pod that needs one (a gap, a join), with a per-frame and an
  overall deadline: the writer goes on with the other pods meanwhile.

Who may speak for a pod:

* dial mode: the socket says who it is; a ``kv@<pod>@...`` topic naming another pod is
  rejected ("wrong_pod"); other topics (vLLM's default ``""``) are fine.
* bind mode: the topic names the pod.  With ``bind_allow: discovered`` (the default)
  only discovered pods' addresses may connect, and a message whose topic names a pod
  that does not have the sender's address is rejected ("wrong_source"), see
  :mod:`router.events.zap`.  The default ``bind_endpoint`` listens on 127.0.0.1 only.

A pod removed from the registry is cleared; per-event log lines are rate-limited
(:mod:`router.events.ratelimit`), the counters (:mod:`router.events.stats`) count all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio
from prometheus_client.registry import CollectorRegistry
from zmq.utils.monitor import parse_monitor_message

from router.events.feed import FaultWindow, PodFeed, Reconnect
from router.events.guard import PodFacts
from router.events.protocol import EventSink
from router.events.ratelimit import limited
from router.events.readers import SocketReaders
from router.events.settings import EventsSettings
from router.events.stats import EventStats, register_event_stats, sink_gauges, sink_stats
from router.events.writer import EventWriter
from router.events.zap import SourceCheck
from router.fleet.pods import PodRegistry, PodSpec

log = logging.getLogger(__name__)


def _spec_model(spec: PodSpec, fallback: str) -> str:
    return spec.models[0] if spec.models else fallback


class KVEventSubscriber(SocketReaders):
    """Subscribes to the KV events of every pod in ``registry`` and feeds ``sink``.

    Use ``await start()`` / ``await stop()`` from the loop that owns it.  In bind mode
    :attr:`bound_endpoint` is the actual endpoint (resolving a ``*`` port).
    ``pod_facts(pod)`` (e.g. the scraper's ``cache_config``) gives a pod's cache size
    and block size for :mod:`router.events.guard`; settable after construction
    (:attr:`pod_facts`).  Its socket readers are its base
    (:class:`~router.events.readers.SocketReaders`).
    """

    def __init__(
        self,
        settings: EventsSettings,
        registry: PodRegistry,
        sink: EventSink,
        *,
        metrics_registry: CollectorRegistry | None = None,
        context: zmq.asyncio.Context | None = None,
        pod_facts: Callable[[str], PodFacts | None] | None = None,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.stats = EventStats()
        self._ctx = context or zmq.asyncio.Context()
        self._own_ctx = context is None
        self._feeds: dict[str, PodFeed] = {}
        self._writer = EventWriter(
            settings, sink, self.stats, self._ctx, lambda end: self._pause(end), pod_facts
        )
        self.stats.queue_depth = lambda: sum(len(f.pending) for f in self._feeds.values())
        self.stats.sink_stats = lambda: sink_stats(self.sink)
        self.stats.sink_gauges = lambda: sink_gauges(self.sink)
        self._tasks: list[asyncio.Task[None]] = []
        self._bind_socket: zmq.asyncio.Socket | None = None
        self.bound_endpoint: str | None = None
        #: bind mode with bind_allow=discovered: the pods' addresses and the ZAP handler
        self.sources: SourceCheck | None = None
        self._running = False
        if metrics_registry is not None:
            register_event_stats(self.stats, metrics_registry)

    @property
    def sink(self) -> Any:
        return self._writer.sink

    @sink.setter
    def sink(self, sink: Any) -> None:
        self._writer.sink = sink

    @property
    def pod_facts(self) -> Callable[[str], PodFacts | None] | None:
        return self._writer.facts_of

    @pod_facts.setter
    def pod_facts(self, fn: Callable[[str], PodFacts | None] | None) -> None:
        self._writer.facts_of = fn

    @property
    def _checks_sources(self) -> bool:
        """Bind mode over TCP with ``bind_allow: discovered``."""
        s = self.settings
        return (
            s.mode == "bind"
            and s.bind_allow == "discovered"
            and s.bind_endpoint.startswith("tcp://")
        )

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        if self._running:
            return
        self._running = True
        self._tasks.append(asyncio.create_task(self._writer.run(), name="kv-events-writer"))
        if self.settings.mode == "bind":
            sock = self._new_sub()
            if self._checks_sources:
                self.sources = SourceCheck(
                    self._ctx,
                    on_admit=lambda _: self._count("zap_admitted"),
                    on_hold=lambda _: self._count("zap_held"),
                )
                self.sources.start(sock)
            sock.bind(self.settings.bind_endpoint)
            self.bound_endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self._bind_socket = sock
            self._tasks.append(
                asyncio.create_task(self._bind_reader(sock), name="kv-events-bind-reader")
            )
            log.info(
                "KV events: SUB bound on %s (publishers allowed: %s)",
                self.bound_endpoint,
                self.settings.bind_allow,
            )
        self.registry.subscribe(self._on_pod)

    def _count(self, attr: str) -> None:
        setattr(self.stats, attr, getattr(self.stats, attr) + 1)

    async def stop(self) -> None:
        self._running = False
        for feed in list(self._feeds.values()):
            self._close_feed(feed)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        await self._writer.stop()
        if self._bind_socket is not None:
            self._bind_socket.close(linger=0)
            self._bind_socket = None
        if self.sources is not None:
            await self.sources.stop()
            self.sources = None
        if self._own_ctx:
            self._ctx.term()

    async def drain(self) -> None:
        """Wait until every queued batch and running replay has been handled (for tests
        and shutdown)."""
        while not self._writer.idle() or any(f.pending or f.replay for f in self._feeds.values()):
            await asyncio.sleep(0.005)

    # -- pods --------------------------------------------------------------------------

    def _on_pod(self, name: str, spec: PodSpec | None) -> None:
        if not self._running:
            return
        feed = self._feeds.get(name)
        if spec is None:
            if feed is not None:
                self._close_feed(feed)
                del self._feeds[name]
            if self.sources is not None:
                self.sources.pod_removed(name)
            self._writer.clear_departed(name, "removed")
            return
        if self.sources is not None:
            self.sources.pod_changed(name, spec)
        model = _spec_model(spec, self.settings.model_fallback)
        if feed is not None:
            endpoint_changed = (
                feed.spec.events_endpoint != spec.events_endpoint
                or feed.spec.replay_endpoint != spec.replay_endpoint
            )
            feed.spec = spec
            if not feed.topic_model:
                feed.model = model
            if not endpoint_changed:
                return
            # a new publisher: start from scratch
            self._close_feed(feed)
            del self._feeds[name]
            self._writer.clear_departed(name, "removed")
        s = self.settings
        feed = PodFeed(
            name=name, spec=spec, model=model, faults=FaultWindow(s.fault_budget, s.fault_window_s)
        )
        self._feeds[name] = feed
        if s.mode == "dial" and spec.events_endpoint:
            sock = self._new_sub()
            sock.connect(spec.events_endpoint)
            feed.socket = sock
            feed.reader = asyncio.create_task(
                self._dial_reader(feed, sock), name=f"kv-events-reader-{name}"
            )
            feed.monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            feed.watcher = asyncio.create_task(
                self._watch_connection(feed, feed.monitor), name=f"kv-events-monitor-{name}"
            )
            log.info("KV events: %s: SUB connected to %s", name, spec.events_endpoint)

    async def _watch_connection(self, feed: PodFeed, monitor: zmq.asyncio.Socket) -> None:
        """A dropped connection may hide an engine restart whose first batches we miss
        (seq would then look like a gap, not a restart): resync at the reconnection."""
        while True:
            frames = await monitor.recv_multipart()
            try:
                event = parse_monitor_message(frames)
            except Exception:
                continue
            if event.get("event") == zmq.EVENT_DISCONNECTED:
                limited(
                    log, f"conn:{feed.name}", "KV events: %s: publisher connection lost", feed.name
                )
                if not (feed.pending and isinstance(feed.pending[-1], Reconnect)):
                    feed.pending.append(Reconnect())
                self._writer.schedule(feed)

    def relearn_all(self, reason: str) -> int:
        """Clear every pod and re-learn it from its replay buffer, in order with its
        batches (the shared index lost its data); the number of pods."""
        for feed in self._feeds.values():
            feed.pending.append(Reconnect(reason))
            self._writer.schedule(feed)
        return len(self._feeds)

    def _close_feed(self, feed: PodFeed) -> None:
        self._writer.close_feed(feed)
        if feed.reader is not None:
            feed.reader.cancel()
            feed.reader = None
        if feed.watcher is not None:
            feed.watcher.cancel()
            feed.watcher = None
        if feed.socket is not None:
            if feed.monitor is not None:
                with contextlib.suppress(zmq.ZMQError):
                    feed.socket.disable_monitor()
                feed.monitor.close(linger=0)
                feed.monitor = None
            feed.socket.close(linger=0)
            feed.socket = None

    def _new_sub(self) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, self.settings.rcvhwm)
        sock.setsockopt(zmq.SUBSCRIBE, self.settings.topic_filter.encode())
        return sock
