"""The dashboards read true on a healthy system, an idle one and a replicated one.

Static checks of the panel JSON and its PromQL, no Prometheus needed (the opt-in
``test_promql_live.py`` evaluates the same properties on a real one):

* no query can evaluate to NaN: every denominator and every quantile is filtered with
  ``> 0`` (an idle window then has no value: a stat says so in its ``noValue``);
* a failure counter shows the series that moved and one 0 line while none did, not "No
  data" and not a legend of all-zero series;
* a count of pods takes a per-pod max first, so two router replicas reporting the same
  four pods still read 4;
* per-second panels carry a per-second unit (tokens in tokens/s);
* the fleet dashboard reads the router's series in the router's namespace.
"""

from __future__ import annotations

import re
from typing import Any

import promql_parser
import pytest

from tests.deploy.conftest import (
    TEMPLATE_VALUES,
    Query,
    dashboard_queries,
    load_dashboards,
    panels,
)
from tests.deploy.promql import (
    filters_zeros_then_falls_back,
    matcher_values,
    nan_problems,
    nodes,
    parse,
    selectors,
    unparen,
    zero_fallback,
)

QUERIES = dashboard_queries()
#: counters of things going wrong: per pod or reason they are all-zero series but for the
#: few that moved, so their panels draw only those (and 0 while none did)
FAILURE_COUNTER = re.compile(
    r"kvroute_(bad_requests|retries|upstream_errors|scrape_errors|tenant_limited"
    r"|health_(failures|ejections|readmissions)"
    r"|event_(gaps|missed_batches|replayed_batches|replay_failures|resyncs"
    r"|decode_errors|apply_errors|malformed_frames|queue_dropped))_total"
)
#: gauges every router replica reports for the same pods
PER_REPLICA_POD_GAUGES = {
    "kvroute_pod_healthy",
    "kvroute_index_entries",
    "kvroute_event_lag_seconds",
}
PER_SECOND_UNITS = {"reqps", "cps"}


def marked(name: str) -> str:
    return f"VAR_{name}"


#: template values that say which variable a matcher used (durations stay durations)
MARKERS = {
    name: value if name.startswith("__") else marked(name)
    for name, value in TEMPLATE_VALUES.items()
}


def unit(panel: dict[str, Any]) -> str | None:
    return panel.get("fieldConfig", {}).get("defaults", {}).get("unit")


def by_labels(agg: Any) -> set[str]:
    m = agg.modifier
    if m is None or m.type != promql_parser.AggModifierType.By:
        return set()
    return set(m.labels)


# -- NaN ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("q", QUERIES, ids=lambda q: q.source)
def test_no_panel_query_can_evaluate_to_nan(q: Query) -> None:
    assert not nan_problems(parse(q)), (q.source, nan_problems(parse(q)))


def test_the_nan_check_catches_an_unguarded_ratio_or_quantile() -> None:
    for expr in (
        "sum(rate(a_total[5m])) / sum(rate(b_total[5m]))",
        "sum(rate(a_total[5m])) / (sum(rate(b_total[5m])) > bool 0)",
        "sum by (pod) (a) / ignoring (pod) group_left () sum(a)",
        "histogram_quantile(0.9, sum by (le) (rate(a_bucket[5m])))",
        "histogram_quantile(0.9, sum by (le) (rate(a_bucket[5m]) > 0))",
    ):
        assert nan_problems(promql_parser.parse(expr)), expr
    for expr in (
        "sum(rate(a_total[5m])) / (sum(rate(b_total[5m])) > 0)",
        "histogram_quantile(0.9, sum by (le) (rate(a_bucket[5m]))) > 0",
    ):
        assert not nan_problems(promql_parser.parse(expr)), expr


@pytest.mark.parametrize("name", ["kvroute-overview.json", "kvroute-fleet.json"])
def test_a_stat_panel_shows_zero_or_says_what_an_empty_result_means(name: str) -> None:
    stats = [p for p in panels(load_dashboards()[name]) if p["type"] == "stat"]
    assert stats
    for p in stats:
        if p["fieldConfig"]["defaults"].get("noValue"):
            continue
        for t in p["targets"]:
            q = Query(f"{name}: {p['title']} {t['refId']}", t["expr"], panel=p)
            assert zero_fallback(parse(q)) is not None, f"{q.source}: empty shows 'No data'"


# -- "No data" and all-zero legends --------------------------------------------------------------


def test_failure_counters_draw_the_series_that_moved_and_zero_while_none_did() -> None:
    checked = []
    for q in QUERIES:
        ast = parse(q)
        per_series = [
            n
            for n in nodes(ast)
            if isinstance(n, promql_parser.AggregateExpr)
            and by_labels(n)
            and any(FAILURE_COUNTER.fullmatch(s.name) for s in selectors(n.expr))
        ]
        if per_series:
            checked.append(q.source)
            assert filters_zeros_then_falls_back(ast), f"{q.source}: {q.expr}"
    assert len(checked) >= 15, checked


def test_a_zero_fallback_needs_a_router_in_the_same_selection_as_its_query() -> None:
    """0 is the truth for a counter a scraped router has not moved, not for a selection
    with no router in it: the fallback reads the query's own namespace and job."""
    fallbacks = 0
    for q in QUERIES:
        ast = parse(q, MARKERS)
        fallback = zero_fallback(ast)
        if fallback is None:
            continue
        fallbacks += 1
        want = {"namespace": marked("namespace"), "job": marked("job"), "component": "serve"}
        assert matcher_values(fallback) == want, q.source
        for sel in selectors(unparen(ast).lhs):
            got = matcher_values(sel)
            assert (got["namespace"], got["job"]) == (want["namespace"], want["job"]), q.source
    assert fallbacks >= 20


def test_the_fallback_check_accepts_only_a_zero_that_shows_when_nothing_else_does() -> None:
    zero = "max(kvroute_build_info) * 0"
    cases = {
        f"sum by (pod) (a) > 0 or on () {zero}": True,
        # vector(0) has no labels: "or" adds it beside every labelled series, and it
        # reads 0 with no router scraped at all
        "sum by (pod) (a) > 0 or vector(0)": False,
        f"sum by (pod) (a) > 0 or on (pod) {zero}": False,
        # one 0 per replica
        "sum by (pod) (a) > 0 or on () kvroute_build_info * 0": False,
        # every all-zero series still drawn
        f"sum by (pod) (a) or on () {zero}": False,
    }
    for expr, ok in cases.items():
        assert filters_zeros_then_falls_back(promql_parser.parse(expr)) == ok, expr


# -- router replicas -----------------------------------------------------------------------------


def test_counts_of_pods_take_a_per_pod_max_first_so_replicas_do_not_multiply_them() -> None:
    counted = []
    for q in QUERIES:
        for n in nodes(parse(q)):
            if not isinstance(n, promql_parser.AggregateExpr) or "pod" in by_labels(n):
                continue
            if str(n.op) not in ("sum", "count", "avg"):
                continue
            if not {s.name for s in selectors(n.expr)} & PER_REPLICA_POD_GAUGES:
                continue
            counted.append(q.source)
            per_pod = [
                m
                for m in nodes(n.expr)
                if isinstance(m, promql_parser.AggregateExpr)
                and str(m.op) in ("max", "min")
                and "pod" in by_labels(m)
            ]
            assert per_pod, f"{q.source}: {n} sums a gauge every replica reports"
    assert any("'Healthy pods' A" in s for s in counted), counted
    assert any("'Healthy pods' B" in s for s in counted), counted


# -- units ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["kvroute-overview.json", "kvroute-fleet.json"])
def test_per_second_panels_have_a_per_second_unit_and_tokens_are_tokens_per_second(
    name: str,
) -> None:
    per_second = [p for p in panels(load_dashboards()[name]) if "/ s" in p["title"]]
    assert per_second
    for p in per_second:
        u = unit(p) or ""
        if "tokens" in p["title"]:
            assert u == "count:tokens/s", p["title"]
        else:
            per_s = u in PER_SECOND_UNITS or (u.startswith("count:") and u.endswith("/s"))
            assert per_s, (p["title"], u)
    assert any("tokens" in p["title"] for p in per_second)


# -- namespaces ----------------------------------------------------------------------------------


def test_the_fleet_dashboard_reads_router_series_in_the_router_namespace() -> None:
    """The router often runs in a namespace of its own: its series in the fleet dashboard
    filter on ``$router_namespace``, the pods' on ``$namespace``."""
    fleet = load_dashboards()["kvroute-fleet.json"]
    variables = {v["name"]: v for v in fleet["templating"]["list"]}
    assert "kvroute_" in variables["router_namespace"]["query"]["query"]
    assert "vllm:" in variables["namespace"]["query"]["query"]
    router_selectors = 0
    for q in (q for q in QUERIES if q.source.startswith("kvroute-fleet.json")):
        for sel in selectors(parse(q, MARKERS)):
            labels = matcher_values(sel)
            if sel.name.startswith("kvroute_"):
                router_selectors += 1
                assert labels["namespace"] == marked("router_namespace"), q.source
                assert marked("namespace") not in labels.values(), q.source
            else:
                assert labels["namespace"] == marked("namespace"), q.source
    assert router_selectors >= 2
