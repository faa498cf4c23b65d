"""The router's Prometheus metrics (prefix ``kvroute_``), one registry per app.

Predicted hit ratio, to graph next to the pods' own counters::

    rate(kvroute_predicted_cached_tokens_total[5m]) / rate(kvroute_prompt_tokens_total[5m])
    vs  rate(vllm:prefix_cache_hits_total[5m]) / rate(vllm:prefix_cache_queries_total[5m])

Nothing here is a module global: :class:`RouterMetrics` owns its
:class:`~prometheus_client.CollectorRegistry`, so several apps (tests, workers) never
collide.  Event-subscriber counters and index sizes are read at scrape time from
callables the app registers (:meth:`RouterMetrics.add_collector`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.registry import Collector

_FAST_BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.5,
)
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class _CallbackCollector(Collector):
    def __init__(self, fn: Callable[[], Iterable[Metric]]) -> None:
        self._fn = fn

    def collect(self) -> Iterable[Metric]:
        return list(self._fn())


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.requests = Counter(
            "kvroute_requests",
            "Requests answered, by model, pod, HTTP status and policy",
            ["model", "pod", "status", "policy"],
            registry=r,
        )
        self.decision_seconds = Histogram(
            "kvroute_routing_decision_seconds",
            "Time from parsed request to chosen pod (tokenize + hash + lookup + policy)",
            buckets=_FAST_BUCKETS,
            registry=r,
        )
        self.tokenize_seconds = Histogram(
            "kvroute_tokenization_seconds",
            "Time to render the chat template and tokenize, by tokenizer",
            ["tokenizer"],
            buckets=_FAST_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "kvroute_prompt_tokens",
            "Prompt tokens routed, by model and pod",
            ["model", "pod"],
            registry=r,
        )
        self.predicted_cached_tokens = Counter(
            "kvroute_predicted_cached_tokens",
            "Prompt tokens the index predicted cached on the chosen pod (any tier)",
            ["model", "pod"],
            registry=r,
        )
        self.approximate_tokenizations = Counter(
            "kvroute_approximate_tokenizations",
            "Requests whose token ids were only estimated (approximate tokenizer)",
            ["model"],
            registry=r,
        )
        self.inflight = Gauge(
            "kvroute_inflight_requests",
            "Requests this router replica is proxying, by pod",
            ["pod"],
            registry=r,
        )
        self.ttft_seconds = Histogram(
            "kvroute_ttft_seconds",
            "Time to first byte of a streaming response body, measured at the router",
            ["model"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "kvroute_retries",
            "Requests retried on the next-best pod, by reason",
            ["reason"],
            registry=r,
        )
        self.upstream_errors = Counter(
            "kvroute_upstream_errors",
            "Failed attempts to reach a pod, by pod and reason",
            ["pod", "reason"],
            registry=r,
        )
        self.bad_requests = Counter(
            "kvroute_bad_requests",
            "Requests rejected before routing, by reason",
            ["reason"],
            registry=r,
        )
        self.scrape_errors = Counter(
            "kvroute_scrape_errors",
            "Failed scrapes of a pod's /metrics, by pod",
            ["pod"],
            registry=r,
        )
        self.index_entries = Gauge(
            "kvroute_index_entries",
            "Distinct (block, tier) entries held in the index, by pod",
            ["pod"],
            registry=r,
        )

    def child(self, metric: MetricWrapperBase, *values: str) -> Any:
        """``metric.labels(*values)``, cached: prometheus_client validates and hashes the
        labels on every call (~2 us), which the hot path pays several times a request."""
        key = (id(metric), values)
        c = self._children.get(key)
        if c is None:
            if len(self._children) > 65_536:  # unbounded label values: stay bounded
                self._children.clear()
            c = self._children[key] = metric.labels(*values)
        return c

    def forget_pod(self, pod: str) -> None:
        """Drop a departed pod's per-pod gauges (and every cached child, which may hold
        one of them)."""
        self._children.clear()
        for gauge in (self.inflight, self.index_entries):
            with contextlib.suppress(KeyError):
                gauge.remove(pod)

    def add_collector(self, fn: Callable[[], Iterable[Metric]]) -> None:
        """Register a callable producing metric families at scrape time."""
        self.registry.register(_CallbackCollector(fn))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def gauge_family(name: str, doc: str, label: str, values: dict[str, float]) -> Metric:
    """A one-label gauge family built at scrape time."""
    fam = GaugeMetricFamily(name, doc, labels=[label])
    for k, v in values.items():
        fam.add_metric([k], v)
    return fam
