"""The router's Prometheus metrics (prefix ``kvroute_``), one registry per app.

Predicted hit ratio, to graph next to the pods' own counters::

    rate(kvroute_predicted_cached_tokens_total[5m]) / rate(kvroute_prompt_tokens_total[5m])
    vs  rate(vllm:prefix_cache_hits_total[5m]) / rate(vllm:prefix_cache_queries_total[5m])

Nothing here is a module global: :class:`RouterMetrics` owns its
:class:`~prometheus_client.CollectorRegistry`, so several apps (tests, workers) never
collide.  Event-subscriber counters and index sizes are read at scrape time from
callables the app registers (:meth:`RouterMetrics.add_collector`).

Re-exported here: the families built at scrape time (:func:`gauge_family`,
:func:`policy_families`, in :mod:`router.scrape_families`) and the process's build
(:func:`kvroute_version`, :func:`register_build_info`, in :mod:`router.build_info`).
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
    generate_latest,
)
from prometheus_client.core import Metric
from prometheus_client.metrics import MetricWrapperBase

from router.build_info import kvroute_version, register_build_info
from router.metric_families import CallbackCollector, HotFamily
from router.scrape_families import gauge_family, policy_families

__all__ = [
    "CONTENT_TYPE",
    "PodMetrics",
    "RouterMetrics",
    "gauge_family",
    "kvroute_version",
    "policy_families",
    "register_build_info",
]

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


class PodMetrics:
    """The children of the per-(model, pod) families that every answered request
    touches, looked up once (:meth:`RouterMetrics.pod_metrics`); a child is created on
    first use, as :meth:`RouterMetrics.child` would."""

    __slots__ = ("_by_status", "_cached", "_labels", "_metrics", "_prompt", "inflight")

    def __init__(self, metrics: RouterMetrics, model: str, pod: str, policy: str) -> None:
        self.inflight = metrics.inflight.labels(pod)
        self._metrics = metrics
        self._labels = (model, pod, policy)
        self._by_status: dict[int, Any] = {}
        self._prompt: Any = None
        self._cached: Any = None

    def requests(self, status: int) -> Any:
        """The ``kvroute_requests`` child of this model, pod, policy and ``status``."""
        child = self._by_status.get(status)
        if child is None:
            model, pod, policy = self._labels
            child = self._by_status[status] = self._metrics.requests.labels(
                model, pod, str(status), policy
            )
        return child

    def served(self, prompt_tokens: int, cached_tokens: int) -> None:
        """Count a request's prompt tokens and predicted cached tokens."""
        if self._prompt is None:
            model, pod, _ = self._labels
            m = self._metrics
            self._prompt = m.prompt_tokens.labels(model, pod)
            self._cached = m.predicted_cached_tokens.labels(model, pod)
        self._prompt.inc(prompt_tokens)
        self._cached.inc(cached_tokens)


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self._pods: dict[tuple[str, str, str], PodMetrics] = {}
        self._usage: dict[tuple[str, str], tuple[Any, Any, Any]] = {}
        # per-request families: HotFamily (see there); the rest: prometheus_client
        self.requests = self._hot(
            "counter",
            "kvroute_requests",
            "Requests answered, by model, pod, HTTP status and policy",
            ("model", "pod", "status", "policy"),
        )
        self.decision_seconds = self._hot(
            "histogram",
            "kvroute_routing_decision_seconds",
            "Time from parsed request to chosen pod (tokenize + hash + lookup + policy)",
            buckets=_FAST_BUCKETS,
        )
        self.tokenize_seconds = self._hot(
            "histogram",
            "kvroute_tokenization_seconds",
            "Time to render the chat template and tokenize, by tokenizer",
            ("tokenizer",),
            buckets=_FAST_BUCKETS,
        )
        self.prompt_tokens = self._hot(
            "counter",
            "kvroute_prompt_tokens",
            "Prompt tokens routed, by model and pod",
            ("model", "pod"),
        )
        self.predicted_cached_tokens = self._hot(
            "counter",
            "kvroute_predicted_cached_tokens",
            "Prompt tokens the index predicted cached on the chosen pod (any tier)",
            ("model", "pod"),
        )
        self.engine_cached_tokens = self._hot(
            "counter",
            "kvroute_engine_cached_tokens",
            "Prompt tokens the pod reported served from its cache (the answer's "
            "usage.prompt_tokens_details.cached_tokens; vLLM with "
            "--enable-prompt-tokens-details), by model and pod",
            ("model", "pod"),
        )
        self.cache_prediction_error = self._hot(
            "counter",
            "kvroute_cache_prediction_error_tokens",
            "Predicted minus reported cached prompt tokens of answers that report them, by "
            "model, pod and direction (over: the index promised more than the pod had; "
            "under: the pod had more); a growing over at one pod means its index drifted",
            ("model", "pod", "direction"),
        )
        self.approximate_tokenizations = Counter(
            "kvroute_approximate_tokenizations",
            "Requests whose token ids were only estimated (approximate tokenizer)",
            ["model"],
            registry=r,
        )
        self.unseen_first_tokens = Counter(
            "kvroute_unseen_first_tokens",
            "Requests whose first token the router did not see (a JSON answer forwarded as "
            "it came) released from their pod's outstanding prefill by the pod's scraped "
            "count of first tokens (vllm:time_to_first_token_seconds_count)",
            registry=r,
        )
        self.inflight = self._hot(
            "gauge",
            "kvroute_inflight_requests",
            "Requests this router replica is proxying, by pod",
            ("pod",),
        )
        self.ttft_seconds = self._hot(
            "histogram",
            "kvroute_ttft_seconds",
            "Time to first byte of a streaming response body (a stream, or a JSON answer the "
            "router assembles from one), measured at the router, by model and the pod that "
            "answered",
            ("model", "pod"),
            buckets=_TTFT_BUCKETS,
        )
        self.retries = Counter(
            "kvroute_retries",
            "Requests retried on the next-best pod, by reason",
            ["reason"],
            registry=r,
        )
        self.upstream_errors = self._hot(
            "counter",
            "kvroute_upstream_errors",
            "Failed attempts to reach a pod, by pod and reason",
            ("pod", "reason"),
        )
        self.bad_requests = Counter(
            "kvroute_bad_requests",
            "Requests rejected before routing, by reason",
            ["reason"],
            registry=r,
        )
        self.responses_unscored = Counter(
            "kvroute_responses_unscored",
            "Responses API requests routed least-loaded because they do not convert exactly "
            "to a chat prompt, by reason",
            ["reason"],
            registry=r,
        )
        self.responses_affinity = Counter(
            "kvroute_responses_affinity",
            "Responses API requests naming a stored response (previous_response_id, GET, "
            "cancel), by result: owner (sent to the pod that created it), unknown (no owner "
            "recorded), owner_gone (its pod is no longer a candidate)",
            ["result"],
            registry=r,
        )
        self.scrape_errors = self._hot(
            "counter",
            "kvroute_scrape_errors",
            "Failed scrapes of a pod's /metrics, by pod",
            ("pod",),
        )
        self.index_entries = Gauge(
            "kvroute_index_entries",
            "Distinct (block, tier) entries held in the index, by pod",
            ["pod"],
            registry=r,
        )
        self._pd_metrics(r)

    def _pd_metrics(self, r: CollectorRegistry) -> None:
        """Prefill/decode disaggregation (router/proxy/disagg.py, docs/pd.md)."""
        self.pd_decisions = Counter(
            "kvroute_pd_decisions",
            "Requests of models whose pods have P/D roles, by model and decision: split "
            "(prefill pod, then decode pod) or direct (the decode pod computes the prompt) "
            "because short, local_faster or no_prefill_pod",
            ["model", "reason"],
            registry=r,
        )
        self.pd_prefill_seconds = self._hot(
            "histogram",
            "kvroute_pd_prefill_seconds",
            "Time of the prefill half of a disaggregated request: sent to the prefill pod "
            "until its whole answer (with kv_transfer_params) is in, by model and prefill pod",
            ("model", "pod"),
            buckets=_TTFT_BUCKETS,
        )
        self.pd_prefill_attempts = self._hot(
            "counter",
            "kvroute_pd_prefill_attempts",
            "Prefill halves sent, by prefill pod and outcome: ok (kv_transfer_params "
            "returned), no_params, status (another non-2xx answer), failed (no answer: "
            "connect, timeout, 502/503, ejected; the next prefill pod is tried)",
            ("pod", "outcome"),
        )
        self.pd_fallbacks = Counter(
            "kvroute_pd_fallbacks",
            "Split requests sent to a decode pod as plain requests (it computes the prompt), "
            "by model and reason: prefill_failed (no prefill pod answered), no_params, "
            "prefill_status, decode_retry (a decode pod failed after it got the request, or "
            "the lease passed)",
            ["model", "reason"],
            registry=r,
        )
        self.pd_transfers = Counter(
            "kvroute_pd_transfers",
            "Decode attempts sent with a prefill pod's kv_transfer_params, by model and "
            "attempt: first, or retry (another decode pod, the same params, within the lease)",
            ["model", "attempt"],
            registry=r,
        )

    def _hot(
        self,
        kind: str,
        name: str,
        doc: str,
        labelnames: tuple[str, ...] = (),
        buckets: tuple[float, ...] = (),
    ) -> HotFamily:
        family = HotFamily(kind, name, doc, labelnames, buckets)
        self.registry.register(family)
        return family

    def child(self, metric: MetricWrapperBase | HotFamily, *values: str) -> Any:
        """``metric.labels(*values)``, cached: prometheus_client validates and hashes the
        labels on every call (~2 us), which the hot path pays several times a request."""
        key = (id(metric), values)
        c = self._children.get(key)
        if c is None:
            if len(self._children) > 65_536:  # unbounded label values: stay bounded
                self._children.clear()
            c = self._children[key] = metric.labels(*values)
        return c

    def pod_metrics(self, model: str, pod: str, policy: str) -> PodMetrics:
        """The per-request children for ``model`` on ``pod`` (cached like :meth:`child`)."""
        key = (model, pod, policy)
        c = self._pods.get(key)
        if c is None:
            if len(self._pods) > 65_536:  # unbounded label values: stay bounded
                self._pods.clear()
            c = self._pods[key] = PodMetrics(self, model, pod, policy)
        return c

    def usage_children(self, model: str, pod: str) -> tuple[Any, Any, Any]:
        """The children an answer's reported cached tokens move, for ``model`` on
        ``pod``: ``engine_cached_tokens``, ``cache_prediction_error`` over and under
        (cached like :meth:`child`, in one lookup)."""
        key = (model, pod)
        c = self._usage.get(key)
        if c is None:
            if len(self._usage) > 65_536:  # unbounded label values: stay bounded
                self._usage.clear()
            error = self.cache_prediction_error
            c = self._usage[key] = (
                self.engine_cached_tokens.labels(model, pod),
                error.labels(model, pod, "over"),
                error.labels(model, pod, "under"),
            )
        return c

    def forget_pod(self, pod: str) -> None:
        """Drop a departed pod's series from every family labelled by pod (and every
        cached child, which may hold one of them): with pods coming and going under new
        names (a Deployment's rollouts), /metrics would otherwise grow without bound.
        A pod that comes back starts its counters from 0, which Prometheus reads as a
        counter reset."""
        self._children.clear()
        self._pods.clear()
        self._usage.clear()
        for family in (
            self.requests,
            self.prompt_tokens,
            self.predicted_cached_tokens,
            self.inflight,
            self.upstream_errors,
            self.scrape_errors,
            self.ttft_seconds,
            self.pd_prefill_seconds,
            self.pd_prefill_attempts,
        ):
            family.remove_where("pod", pod)
        with contextlib.suppress(KeyError):
            self.index_entries.remove(pod)

    def add_collector(self, fn: Callable[[], Iterable[Metric]]) -> None:
        """Register a callable producing metric families at scrape time."""
        self.registry.register(CallbackCollector(fn))

    def render(self) -> bytes:
        return generate_latest(self.registry)
