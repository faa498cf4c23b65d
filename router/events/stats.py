"""Counters of the KV-event subscriber, and their Prometheus exposition.

The subscriber only bumps plain integers (cheap, no locks: one event loop); a
:class:`EventStatsCollector` registered in a ``CollectorRegistry`` turns them into
``kvroute_event_*`` metric families at scrape time.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

#: reasons a pod's index entries are dropped and re-learned
RESYNC_REASONS = (
    "gap",
    "overflow",
    "decode_error",
    "lost_events",
    "apply_error",
    "restart",
    "reconnect",
    "removed",
    "join_gap",
    "rejected",
    "quarantine",
    "data_loss",
)

#: reasons a message or batch is refused (``kvroute_event_rejected_total{pod,reason}``)
REJECT_REASONS = (
    # the pod's GPU blocks would exceed its KV cache (vllm:cache_config_info num_gpu_blocks)
    "capacity",
    # a BlockStored whose block_size is not the pod's (vllm:cache_config_info block_size)
    "block_size",
    # dial mode: the topic kv@<pod>@... names another pod than the socket's
    "wrong_pod",
    # bind mode: the topic names a pod whose addresses do not include the sender's
    "wrong_source",
    # the pod is quarantined (too many faults): its messages are dropped unread
    "quarantined",
)


@dataclass
class PodEventStats:
    """Counters for one pod (kept after the pod goes away: counters never go back)."""

    batches: int = 0
    events: int = 0
    gaps: int = 0
    missed_batches: int = 0
    replays: int = 0
    replay_failures: int = 0
    replayed_batches: int = 0
    restarts: int = 0
    resyncs: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    malformed_frames: int = 0
    decode_errors: int = 0
    apply_errors: int = 0
    dropped: int = 0
    rejected: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    #: faults (undecodable, rejected, partly skipped batches) that quarantined the pod
    quarantines: int = 0
    #: batches waiting for the writer (live ones, and a replay's while it is applied)
    queued: int = 0
    #: seconds between the batch's engine timestamp and its application (last batch)
    lag_s: float = 0.0
    last_seq: int = -1

    @property
    def total_resyncs(self) -> int:
        return sum(self.resyncs.values())


@dataclass
class EventStats:
    """All counters of one subscriber."""

    pods: dict[str, PodEventStats] = field(default_factory=lambda: defaultdict(PodEventStats))
    #: bind mode: batches whose topic named no registered pod, or was not kv@<pod>@<model>
    unknown_pod_batches: int = 0
    bad_topics: int = 0
    #: bind mode, bind_allow=discovered: connections admitted / held back (ZAP)
    zap_admitted: int = 0
    zap_held: int = 0
    queue_depth: Callable[[], int] = lambda: 0
    #: the sink's own counters (``scoring.events.ApplierStats``: orphans, bad events...)
    sink_stats: Callable[[], dict[str, Any]] = dict
    #: the sink's gauges (engine-hash mode: enabled, learned blocks, learn queue depth)
    sink_gauges: Callable[[], dict[str, float]] = dict

    def pod(self, name: str) -> PodEventStats:
        return self.pods[name]

    def total(self, attr: str) -> int:
        return sum(getattr(p, attr) for p in self.pods.values())


_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("event_batches", "batches", "KV-event batches applied to the index"),
    ("events_ingested", "events", "KV events applied to the index"),
    ("event_gaps", "gaps", "seq gaps detected (batches lost between publisher and us)"),
    ("event_missed_batches", "missed_batches", "batches missing across all gaps"),
    ("event_replays", "replays", "replay requests that recovered a gap"),
    ("event_replay_failures", "replay_failures", "replay requests that failed"),
    ("event_replayed_batches", "replayed_batches", "batches recovered by replay"),
    ("event_engine_restarts", "restarts", "engine restarts detected (seq went down)"),
    ("event_malformed_frames", "malformed_frames", "ZMQ messages with bad framing"),
    ("event_decode_errors", "decode_errors", "payloads that failed to decode"),
    ("event_apply_errors", "apply_errors", "batches the index failed to apply"),
    ("event_queue_dropped", "dropped", "batches dropped because the queue was full"),
)


class EventStatsCollector(Collector):
    """Exposes :class:`EventStats` as ``kvroute_event_*`` metrics."""

    def __init__(self, stats: EventStats) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        pods = list(self._stats.pods.items())
        for name, attr, doc in _COUNTERS:
            fam = CounterMetricFamily(f"kvroute_{name}", doc, labels=["pod"])
            for pod, st in pods:
                fam.add_metric([pod], getattr(st, attr))
            yield fam
        resync = CounterMetricFamily(
            "kvroute_event_resyncs",
            "times a pod's index entries were cleared to be re-learned, by reason",
            labels=["pod", "reason"],
        )
        for pod, st in pods:
            for reason, n in st.resyncs.items():
                resync.add_metric([pod, reason], n)
        yield resync
        rejected = CounterMetricFamily(
            "kvroute_event_rejected",
            "KV-event messages or batches refused, by pod and reason (capacity, block_size, "
            "wrong_pod, wrong_source, quarantined)",
            labels=["pod", "reason"],
        )
        for pod, st in pods:
            for reason, n in st.rejected.items():
                rejected.add_metric([pod, reason], n)
        yield rejected
        quarantines = CounterMetricFamily(
            "kvroute_event_quarantines",
            "times a pod exceeded events.fault_budget and its events were dropped for "
            "events.fault_window_s",
            labels=["pod"],
        )
        for pod, st in pods:
            quarantines.add_metric([pod], st.quarantines)
        yield quarantines
        queued = GaugeMetricFamily(
            "kvroute_event_pod_queue_depth",
            "batches of the pod waiting for the index writer",
            labels=["pod"],
        )
        for pod, st in pods:
            queued.add_metric([pod], st.queued)
        yield queued
        lag = GaugeMetricFamily(
            "kvroute_event_lag_seconds",
            "now minus the engine timestamp of the pod's last applied batch",
            labels=["pod"],
        )
        for pod, st in pods:
            lag.add_metric([pod], st.lag_s)
        yield lag
        yield CounterMetricFamily(
            "kvroute_event_unknown_pod_batches",
            "bind mode: batches from a topic naming no registered pod",
            value=self._stats.unknown_pod_batches,
        )
        yield CounterMetricFamily(
            "kvroute_event_bad_topics",
            "bind mode: batches whose topic is not kv@<pod>@<model>",
            value=self._stats.bad_topics,
        )
        yield CounterMetricFamily(
            "kvroute_event_zap_admitted",
            "bind mode (bind_allow=discovered): publisher connections admitted",
            value=self._stats.zap_admitted,
        )
        yield CounterMetricFamily(
            "kvroute_event_zap_held",
            "bind mode (bind_allow=discovered): connection attempts from an address no "
            "discovered pod has (held until discovery names it, else timed out)",
            value=self._stats.zap_held,
        )
        for key, value in self._stats.sink_stats().items():
            if isinstance(value, int) and not isinstance(value, bool):
                yield CounterMetricFamily(
                    f"kvroute_event_applier_{key}",
                    f"KV-event applier counter {key} (scoring.events.ApplierStats)",
                    value=value,
                )
        for key, gauge in self._stats.sink_gauges().items():
            yield GaugeMetricFamily(
                f"kvroute_event_{key}",
                f"KV-event sink gauge {key} (router.events.IndexSink)",
                value=gauge,
            )
        yield GaugeMetricFamily(
            "kvroute_event_queue_depth",
            "batches waiting between the socket readers and the index writer",
            value=self._stats.queue_depth(),
        )


def sink_stats(sink: Any) -> dict[str, Any]:
    """A sink's counters: its ``stats`` (``as_dict()`` or a callable) and ``extra_stats()``."""
    raw = getattr(sink, "stats", None)
    out: dict[str, Any] = {}
    if raw is None:
        pass
    elif hasattr(raw, "as_dict"):
        out = dict(raw.as_dict())
    elif callable(raw):
        out = dict(raw())
    extra = getattr(sink, "extra_stats", None)
    if callable(extra):
        out.update(extra())
    return out


def sink_gauges(sink: Any) -> dict[str, float]:
    """A sink's ``gauges()``, if it has them."""
    fn = getattr(sink, "gauges", None)
    return dict(fn()) if callable(fn) else {}


def register_event_stats(stats: EventStats, registry: CollectorRegistry) -> EventStatsCollector:
    collector = EventStatsCollector(stats)
    registry.register(collector)
    return collector
