"""The Grafana dashboards and Prometheus rules name only what kvroute really exports.

Truth is taken from the running thing: ``kvroute serve`` in front of ``kvroute sim`` pods
(``kvroute_stack`` in conftest.py) after some traffic, its ``/metrics`` and a pod's
``/metrics`` parsed with prometheus_client's text parser.  A family the live router
declares but has no sample of yet (no retry, no resync happened) gets its label names
from the same collectors in process, each fed one value.  PromQL is parsed with
``promql-parser`` (the Rust parser Prometheus-compatible tools use).

No Prometheus is needed here; ``test_promql_live.py`` runs every expression on one.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import promql_parser
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.conftest import (
    Query,
    Stack,
    dashboard_queries,
    load_dashboards,
    load_rules,
    panels,
    rule_queries,
)
from tests.deploy.promql import is_ratio_or_quantile, nodes, parse, selectors, zero_fallback

#: labels Prometheus attaches to every scraped series (kubernetes_sd / static_configs)
TARGET_LABELS = frozenset({"namespace", "job", "instance"})
#: vLLM series have no pod label of their own: it is the Kubernetes target label
VLLM_TARGET_LABELS = TARGET_LABELS | {"pod"}
#: real vLLM 0.32 exports these (vllm/v1/metrics/loggers.py); the simulated pod does not
VLLM_ONLY = {
    "vllm:num_preemptions_total": frozenset({"model_name", "engine"}),
}
REAL_VLLM_ONLY_NOTE = "Real vLLM only"
UIDS = {"kvroute-overview.json": "kvroute-overview", "kvroute-fleet.json": "kvroute-fleet"}
ALL_QUERIES = dashboard_queries() + rule_queries()


# -- what the running router and pod expose ----------------------------------------------------


def series_labels(text: str) -> dict[str, set[str]]:
    """Series name -> label names, from a Prometheus text exposition.  A family declared
    with no sample still contributes its series names (with no labels known)."""
    out: dict[str, set[str]] = defaultdict(set)
    for fam in text_string_to_metric_families(text):
        suffixes = {
            "counter": ("_total",),
            "histogram": ("_bucket", "_sum", "_count"),
            "summary": ("_sum", "_count"),
        }.get(fam.type, ("",))
        for suffix in suffixes:
            out.setdefault(fam.name + suffix, set())
        for s in fam.samples:
            out[s.name] |= set(s.labels)
    return dict(out)


def labels_from_code() -> dict[str, set[str]]:
    """Label names of every router family, from the router's own collectors, each
    given one child (the live run cannot provoke every retry reason or resync)."""
    from router.events.stats import EventStats, register_event_stats
    from router.fleet.health import _HealthCollector
    from router.metrics import RouterMetrics
    from router.tenants.limits import TenantMetrics

    m = RouterMetrics()
    for family in [*vars(m).values(), *vars(TenantMetrics(m.registry)).values()]:
        names = getattr(family, "labelnames", None) or getattr(family, "_labelnames", None)
        if names:
            family.labels(*["x"] * len(names))
    stats = EventStats()
    stats.pod("x").resyncs["gap"] += 1
    register_event_stats(stats, m.registry)
    checker = SimpleNamespace(
        registry=SimpleNamespace(
            all=lambda: [SimpleNamespace(name="x", healthy=True, models={"m"})]
        ),
        panic={"m"},
        failures={"x": 1},
        ejections={"x": 1},
        readmissions={"x": 1},
    )
    m.registry.register(_HealthCollector(checker))  # type: ignore[arg-type]
    return series_labels(m.render().decode())


@pytest.fixture(scope="module")
def exposed(kvroute_stack: Stack) -> dict[str, set[str]]:
    """Series name -> label names that the live router and a live pod expose."""
    router = series_labels(httpx.get(f"{kvroute_stack.router_url}/metrics").text)
    pod = series_labels(httpx.get(f"{kvroute_stack.sims['sim-0']}/metrics").text)
    assert not router.keys() & pod.keys()
    code = labels_from_code()
    for name, labels in router.items():
        if not labels and code.get(name):
            labels |= code[name]
    return {**router, **pod}


@pytest.fixture(scope="module")
def uncounted(kvroute_stack: Stack) -> set[str]:
    """Counter series the live router declares but has no sample of yet (nothing was
    retried, resynced, estimated... in its traffic): Prometheus stores nothing for them."""
    text = httpx.get(f"{kvroute_stack.router_url}/metrics").text
    out = set()
    for fam in text_string_to_metric_families(text):
        if fam.type == "counter" and not fam.samples:
            out.add(fam.name + "_total")
    return out


# -- PromQL walking ------------------------------------------------------------------------------


def matchers(sel: Any) -> Iterator[Any]:
    yield from sel.matchers.matchers
    for group in sel.matchers.or_matchers or []:
        yield from group


def allowed_labels(name: str, exposed: dict[str, set[str]]) -> set[str]:
    if name in VLLM_ONLY:
        return set(VLLM_ONLY[name] | VLLM_TARGET_LABELS)
    own = exposed.get(name, set())
    return own | (VLLM_TARGET_LABELS if name.startswith("vllm:") else TARGET_LABELS)


def label_problems(ast: Any, exposed: dict[str, set[str]]) -> list[str]:
    """Labels matched, grouped by or vector-matched on that the series do not carry."""
    problems = []
    for sel in selectors(ast):
        ok = allowed_labels(sel.name, exposed)
        for m in matchers(sel):
            if m.name != "__name__" and m.name not in ok:
                problems.append(f"{sel.name}{{{m.name}...}}: no label {m.name!r}")
    for n in nodes(ast):
        if isinstance(n, promql_parser.AggregateExpr) and n.modifier is not None:
            # by / without: every series aggregated must carry the label
            for sel in selectors(n.expr):
                missing = set(n.modifier.labels) - allowed_labels(sel.name, exposed)
                if missing:
                    problems.append(f"{n.op} by/without {sorted(missing)} over {sel.name}")
        if isinstance(n, promql_parser.BinaryExpr) and n.modifier is not None:
            # on / ignoring / group_left: some series on either side carries the label
            used = set(n.modifier.group_labels or [])
            if n.modifier.matching is not None:
                used |= set(n.modifier.matching.labels)
            have = set().union(*(allowed_labels(s.name, exposed) for s in selectors(n)))
            if used - have:
                problems.append(f"vector matching on {sorted(used - have)}: no series has them")
    return problems


# -- dashboards: structure ---------------------------------------------------------------------


def test_the_dashboards_are_exactly_overview_and_fleet_with_stable_uids() -> None:
    dashboards = load_dashboards()
    assert {name: d["uid"] for name, d in dashboards.items()} == UIDS


@pytest.mark.parametrize("name", sorted(UIDS))
def test_a_dashboard_is_grafana_39_plus_with_datasource_namespace_job_pod_variables(
    name: str,
) -> None:
    d = load_dashboards()[name]
    assert d["schemaVersion"] >= 39
    assert d["title"] and d["panels"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for var in ("namespace", "job", "pod"):
        assert variables[var]["type"] == "query", var
        assert variables[var]["datasource"]["uid"] == "${datasource}", var
        # "All" must match every value, including a series with no such label
        assert variables[var]["includeAll"] and variables[var]["allValue"] == ".*", var


@pytest.mark.parametrize("name", sorted(UIDS))
def test_panel_ids_are_unique_and_every_panel_has_a_grid_position(name: str) -> None:
    ps = list(panels(load_dashboards()[name]))
    ids = [p["id"] for p in ps]
    assert len(ids) == len(set(ids)), sorted(i for i in ids if ids.count(i) > 1)
    for p in ps:
        assert {"x", "y", "w", "h"} <= p["gridPos"].keys(), p["title"]
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24, p["title"]


@pytest.mark.parametrize("name", sorted(UIDS))
def test_every_panel_and_target_queries_the_datasource_variable(name: str) -> None:
    for p in panels(load_dashboards()[name]):
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], f"panel {p['title']!r} has no query"
        ref_ids = [t["refId"] for t in p["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert t["expr"].strip(), p["title"]


# -- dashboards and rules: PromQL ----------------------------------------------------------------


@pytest.mark.parametrize("q", ALL_QUERIES, ids=lambda q: q.source)
def test_every_expression_parses_once_template_variables_are_filled(q: Query) -> None:
    assert selectors(parse(q)), f"{q.source} reads no metric"


def test_dashboards_do_not_need_the_recording_rules() -> None:
    recorded = {r["record"] for r in load_rules() if "record" in r}
    for q in dashboard_queries():
        assert not {s.name for s in selectors(parse(q))} & recorded, q.source


def test_every_metric_the_queries_read_is_exposed_by_the_router_or_a_pod(
    exposed: dict[str, set[str]],
) -> None:
    unknown = {
        f"{q.source}: {s.name}"
        for q in ALL_QUERIES
        for s in selectors(parse(q))
        if s.name not in exposed and s.name not in VLLM_ONLY
    }
    assert not unknown, sorted(unknown)


def test_every_label_the_queries_use_exists_on_its_metric(exposed: dict[str, set[str]]) -> None:
    problems = [f"{q.source}: {p}" for q in ALL_QUERIES for p in label_problems(parse(q), exposed)]
    assert not problems, problems


def test_the_label_check_catches_a_wrong_label(exposed: dict[str, set[str]]) -> None:
    """The check above can fail: a label the family lacks, in any position, is caught."""
    for expr in (
        'sum by (pod) (rate(kvroute_tokenization_seconds_count{tokenizer="x"}[5m]))',
        'rate(kvroute_requests_total{endpoint="/v1/chat/completions"}[5m])',
        "kvroute_inflight_requests / on (reason) kvroute_index_entries",
        "sum by (status) (vllm:num_requests_waiting)",
    ):
        assert label_problems(promql_parser.parse(expr), exposed), expr


def test_a_counter_the_router_has_not_moved_yet_reads_zero_not_no_data(
    uncounted: set[str],
) -> None:
    """A fresh, healthy router has counted no retry, resync or approximate tokenization:
    the panels reading those counters fall back to 0 (tests/deploy/promql.py)."""
    assert {"kvroute_retries_total", "kvroute_event_resyncs_total"} <= uncounted, uncounted
    read = 0
    for q in dashboard_queries():
        ast = parse(q)
        if {s.name for s in selectors(ast)} & uncounted and not is_ratio_or_quantile(ast):
            read += 1
            assert zero_fallback(ast) is not None, f"{q.source}: 'No data' until it counts"
    assert read >= 5


def test_real_vllm_only_metrics_are_absent_from_the_sim_and_flagged_on_their_panels(
    exposed: dict[str, set[str]],
) -> None:
    assert not VLLM_ONLY.keys() & exposed.keys(), "the sim exports it now: drop it from VLLM_ONLY"
    for q in dashboard_queries():
        if {s.name for s in selectors(parse(q))} & VLLM_ONLY.keys():
            assert q.panel is not None
            assert str(q.panel["description"]).startswith(REAL_VLLM_ONLY_NOTE), q.source


@pytest.mark.parametrize("name", sorted(UIDS))
def test_variable_queries_read_exposed_metrics_and_labels(
    name: str, exposed: dict[str, set[str]]
) -> None:
    for var in load_dashboards()[name]["templating"]["list"]:
        if var["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["query"]["query"])
        assert m, var["name"]
        ast = promql_parser.parse(m.group(1))
        assert not label_problems(ast, exposed), var["name"]
        for sel in selectors(ast):
            assert sel.name in exposed, (var["name"], sel.name)
            assert m.group(2) in allowed_labels(sel.name, exposed), (var["name"], m.group(2))


def test_the_overview_shows_every_router_signal_and_the_fleet_the_pods_signals() -> None:
    read: dict[str, set[str]] = defaultdict(set)
    for q in dashboard_queries():
        read[q.source.split(":")[0]] |= {s.name for s in selectors(parse(q))}
    assert {
        "kvroute_requests_total",
        "kvroute_bad_requests_total",
        "kvroute_upstream_errors_total",
        "kvroute_routing_decision_seconds_bucket",
        "kvroute_ttft_seconds_bucket",
        "kvroute_tokenization_seconds_bucket",
        "kvroute_predicted_cached_tokens_total",
        "kvroute_prompt_tokens_total",
        "kvroute_inflight_requests",
        "kvroute_index_entries",
        "kvroute_events_ingested_total",
        "kvroute_event_gaps_total",
        "kvroute_event_resyncs_total",
        "kvroute_event_decode_errors_total",
        "kvroute_scrape_errors_total",
        "kvroute_pod_healthy",
    } <= read["kvroute-overview.json"]
    assert {
        "vllm:prefix_cache_hits_total",
        "vllm:prefix_cache_queries_total",
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:time_to_first_token_seconds_bucket",
    } <= read["kvroute-fleet.json"]


# -- rules: format -----------------------------------------------------------------------------


def test_the_rules_file_is_a_plain_prometheus_rule_file() -> None:
    rules = load_rules()
    names = [r.get("record") or r.get("alert") for r in rules]
    assert all(names) and len(names) == len(set(names)), names
    for r in rules:
        assert ("record" in r) != ("alert" in r), r
        if "record" in r:
            # level:metric:operations (https://prometheus.io/docs/practices/rules/)
            assert re.fullmatch(r"[a-z_]+:[a-z_]+:[a-z0-9_]+", r["record"]), r["record"]
        else:
            assert r["labels"]["severity"] in ("critical", "warning"), r["alert"]
            assert r["annotations"]["summary"] and r["annotations"]["description"], r["alert"]


def test_the_alerts_cover_the_failure_modes() -> None:
    alerts = {r["alert"]: str(r["expr"]) for r in load_rules() if "alert" in r}
    reads = {
        "KvrouteNoReadyPod": "kvroute_pod_healthy",
        "KvrouteHighErrorRate": "kvroute_requests_total",
        "KvrouteKVEventGaps": "kvroute_event_gaps_total",
        "KvrouteKVEventResyncs": "kvroute_event_resyncs_total",
        "KvrouteIndexEmptyWhileServing": "kvroute_index_entries",
        "KvroutePodScrapeFailing": "kvroute_scrape_errors_total",
        "KvrouteIndexDrift": "kvroute_cache_prediction_error_tokens_total",
    }
    for alert, metric in reads.items():
        assert metric in alerts[alert], alert
