"""Metric families built at scrape time from plain values (the callables given to
:meth:`router.metrics.RouterMetrics.add_collector`): a one-label gauge
(:func:`gauge_family`) and what the routing policy learned and rejected
(:func:`policy_families`).  Both are re-exported by :mod:`router.metrics`."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


def gauge_family(name: str, doc: str, label: str, values: dict[str, float]) -> Metric:
    """A one-label gauge family built at scrape time."""
    fam = GaugeMetricFamily(name, doc, labels=[label])
    for k, v in values.items():
        fam.add_metric([k], v)
    return fam


def _learned_family(
    metric: str, doc: str, of: str, policy: str, values: dict[tuple[str, str], float]
) -> Metric:
    """A gauge family ``{policy,quantity,<of>}`` of ``values`` keyed (quantity, of)."""
    fam = GaugeMetricFamily(metric, doc, labels=["policy", "quantity", of])
    for (quantity, key), v in values.items():
        fam.add_metric([policy, quantity, key], v)
    return fam


def policy_families(
    name: str,
    learned: dict[tuple[str, str], float],
    rejected: dict[str, int],
    per_pod: dict[tuple[str, str], float],
) -> list[Metric]:
    """``kvroute_policy_learned{policy,quantity,model}`` (what the routing policy learned
    from its observations: ``cost``'s prefill rate and decode time, per model),
    ``kvroute_policy_pod_learned{policy,quantity,pod}`` (what it learned per pod:
    ``cost``'s pace with ``queue_slowness``) and
    ``kvroute_policy_rejected_observations_total{policy,reason}`` (observations it
    dropped as bad input), built at scrape time from ``Policy.learned``,
    ``Policy.learned_per_pod`` and ``Policy.rejected_observations``."""
    fam = _learned_family(
        "kvroute_policy_learned",
        "What the routing policy learned from its observations, by quantity and model",
        "model",
        name,
        learned,
    )
    pods = _learned_family(
        "kvroute_policy_pod_learned",
        "What the routing policy learned about each pod from its observations, by quantity",
        "pod",
        name,
        per_pod,
    )
    bad = CounterMetricFamily(
        "kvroute_policy_rejected_observations",
        "Observations the routing policy dropped as bad input, by reason",
        labels=["policy", "reason"],
    )
    for reason, n in rejected.items():
        bad.add_metric([name, reason], n)
    return [fam, pods, bad]
