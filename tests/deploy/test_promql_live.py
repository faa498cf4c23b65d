"""Every dashboard query and every rule, evaluated by a real Prometheus scraping kvroute.

Opt-in (``python3 -m pytest -m prometheus tests/deploy``); skipped when no ``prometheus``
binary is on PATH (Debian: ``apt-get install prometheus``).  The stack of conftest.py
with two router replicas that share nothing but the pods (two ``kvroute serve`` in
front of ``sim-0``, ``sim-1``, ``quiet-0`` without KV events, and ``dead-0`` that nobody
serves) is scraped every second by a Prometheus started here on 127.0.0.1 with the
rules file loaded.  The scrape config mirrors Kubernetes: ``namespace`` on every target
(the routers in a namespace of their own), the vLLM pods' ``pod`` as a target label,
the routers scraped with ``honor_labels`` (their series carry ``pod`` = the vLLM pod a
request went to) as two instances of one job.

Prometheus first records an idle stretch (no request in a whole rate window: every
ratio is 0/0, every quantile has no observation), then a background thread keeps
completions flowing through both replicas.  Panel queries are evaluated at both times.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml

from tests.deploy.conftest import (
    MODEL,
    NAMESPACE,
    ROUTER_NAMESPACE,
    RULES,
    TEMPLATE_VALUES,
    Query,
    Stack,
    child_env,
    dashboard_queries,
    free_port,
    load_dashboards,
    load_rules,
    rule_queries,
    stop,
    substitute,
    template_values,
    tenant_auth,
    wait_http,
    warm_stack,
)
from tests.deploy.promql import filters_zeros_then_falls_back, is_ratio_or_quantile, parse

pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.skipif(shutil.which("prometheus") is None, reason="no prometheus binary on PATH"),
]

ROUTERS = 2
#: the tenant of the traffic's other requests
KEY = tenant_auth("team-a")
#: the window a panel's rate() reads
WINDOW = TEMPLATE_VALUES["__rate_interval"]
REAL_VLLM_ONLY = "Real vLLM only"
#: panels that draw only split requests: the stack's pods have no P/D roles
PD_ONLY = "P/D fleets only"


def filled(q: Query) -> str:
    """``q``'s expression with its dashboard's template values."""
    assert q.dashboard is not None
    return substitute(q.expr, template_values(q.dashboard))


def real_vllm_only(q: Query) -> bool:
    assert q.panel is not None
    return str(q.panel["description"]).startswith(REAL_VLLM_ONLY)


def pd_only(q: Query) -> bool:
    assert q.panel is not None
    return str(q.panel["description"]).startswith(PD_ONLY)


#: alert expressions that the stack makes true, and the pod each names (None: the alert
#: is about the router, not a pod)
ALERTS_FIRING = {
    "KvroutePodUnhealthy": "dead-0",
    "KvroutePodScrapeFailing": "dead-0",
    "KvrouteIndexEmptyWhileServing": "quiet-0",
    # half of the traffic's follow-ups name a response nobody stored
    "KvrouteResponsesOwnerUnknown": None,
}
#: alert expressions that must stay false on this healthy-enough stack
ALERTS_QUIET = {
    "KvrouteNoReadyPod",
    "KvrouteHighErrorRate",
    "KvrouteKVEventGaps",
    "KvrouteKVEventResyncs",
    "KvrouteKVEventsDropped",
    "KvrouteKVEventLagHigh",
}


class Traffic:
    """Chat completions through the routers from a thread, until stopped, ten to one
    replica then ten to the next; of each ten, one asks for a model nobody serves (a 404
    counted in kvroute_bad_requests_total), one is a Responses API round: a response
    (with a function-call item: unscored), a follow-up naming it (its owner is known)
    and one naming a response nobody stored, and one is the ``capped`` tenant's (two
    requests a minute: 429s once its bucket is empty)."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.sent = 0
        self.statuses: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30.0) as client:
            while not self._stop.is_set():
                i = self.sent
                router = self.stack.router_urls[i // 10 % len(self.stack.router_urls)]
                if i % 10 == 9:
                    messages = [{"role": "user", "content": "x"}]
                    body = {"model": "no-such-model", "messages": messages}
                    r = client.post(f"{router}/v1/chat/completions", json=body, headers=KEY)
                    status = r.status_code
                elif i % 10 == 4:
                    status = self._responses(client, router, i)
                elif i % 10 == 7:
                    status = self.stack.chat(1000 + i, router, tenant="capped")
                else:
                    status = self.stack.chat(1000 + i, router)
                self.statuses[status] = self.statuses.get(status, 0) + 1
                self.sent += 1
                self._stop.wait(0.1)

    def _responses(self, client: httpx.Client, router: str, i: int) -> int:
        url = f"{router}/v1/responses"
        call = {"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": "{}"}
        body = {"model": MODEL, "input": [call], "max_output_tokens": 4}
        first = client.post(url, json=body, headers=KEY)
        if first.status_code != 200:
            return first.status_code
        follow = {"model": MODEL, "input": "and then?", "max_output_tokens": 4}
        named = {**follow, "previous_response_id": first.json()["id"]}
        known = client.post(url, json=named, headers=KEY)
        never = {**follow, "previous_response_id": f"resp_never_stored_{i}"}
        client.post(url, json=never, headers=KEY)
        return known.status_code

    def __enter__(self) -> Traffic:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url
        #: a time (Unix seconds) when no request had been sent for a whole rate window
        self.idle_at = 0.0

    def get(self, path: str, **params: Any) -> Any:
        r = httpx.get(f"{self.url}{path}", params=params, timeout=30.0)
        body = r.json()
        assert body["status"] == "success", f"{path} {params}: {body}"
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params = {"query": expr} if at is None else {"query": expr, "time": at}
        data = self.get("/api/v1/query", **params)
        assert data["resultType"] in ("vector", "scalar"), data
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])


def prometheus_config(stack: Stack) -> dict[str, Any]:
    def target(url: str) -> str:
        return url.removeprefix("http://")

    return {
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {
                "job_name": "kvroute",
                "honor_labels": True,
                "static_configs": [
                    {
                        "targets": [target(url) for url in stack.router_urls],
                        "labels": {"namespace": ROUTER_NAMESPACE},
                    }
                ],
            },
            {
                "job_name": "vllm",
                "static_configs": [
                    {"targets": [target(url)], "labels": {"namespace": NAMESPACE, "pod": name}}
                    for name, url in stack.sims.items()
                ],
            },
        ],
    }


@pytest.fixture(scope="module")
def kvroute_stack() -> Iterator[Stack]:
    """conftest.py's stack with two router replicas (overrides its one-router fixture)."""
    with warm_stack(routers=ROUTERS) as stack:
        yield stack


@pytest.fixture(scope="module")
def prometheus(
    kvroute_stack: Stack, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Prometheus]:
    tmp = tmp_path_factory.mktemp("prometheus")
    config = tmp / "prometheus.yml"
    config.write_text(yaml.safe_dump(prometheus_config(kvroute_stack)))
    check = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True)
    assert check.returncode == 0, check.stdout + check.stderr
    port = free_port()
    log = (tmp / "prometheus.log").open("wb")
    proc = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--storage.tsdb.retention.time=1h",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=child_env(),
    )
    try:
        prom = Prometheus(f"http://127.0.0.1:{port}")
        wait_http(f"{prom.url}/-/ready", timeout=60)
        prom.idle_at = wait_for_idle_window(prom, kvroute_stack)
        with Traffic(kvroute_stack) as traffic:
            wait_for_data(prom, kvroute_stack)
            yield prom
        assert traffic.statuses.get(200, 0) > 0, traffic.statuses
    finally:
        stop(proc)
        log.close()


def targets(stack: Stack) -> int:
    return len(stack.router_urls) + len(stack.sims)


def wait_for_idle_window(prom: Prometheus, stack: Stack, timeout: float = 90.0) -> float:
    """A time at which every target has been scraped for a whole rate window with no
    request sent (the stack's warm-up traffic ended before Prometheus started)."""
    samples = int(WINDOW.removesuffix("s")) // 2  # of the ~20 at a 1 s scrape interval
    expr = f"count(count_over_time(up[{WINDOW}]) >= {samples}) == {targets(stack)}"
    deadline = time.monotonic() + timeout
    while not prom.query(expr):
        if time.monotonic() > deadline:
            raise AssertionError(f"no idle window after {timeout} s: {expr}")
        time.sleep(1.0)
    return time.time()


def wait_for_data(prom: Prometheus, stack: Stack, timeout: float = 90.0) -> None:
    """Until every target is up and the rates the panels use have two samples each."""
    window = WINDOW
    needed = (
        f"sum(up) == {targets(stack)}",
        f"sum(rate(kvroute_requests_total[{window}])) > 0",
        f'rate(kvroute_requests_total{{pod="{stack.quiet_pod}"}}[1m]) > 0',
        f"rate(vllm:prefix_cache_hits_total[{window}]) > 0",
        f"rate(kvroute_bad_requests_total[{window}]) > 0",
        f"rate(kvroute_tenant_limited_total[{window}]) > 0",
        f"rate(kvroute_tenant_ttft_seconds_count[{window}]) > 0",
        "kvroute_health_failures_total",
    )
    deadline = time.monotonic() + timeout
    while True:
        missing = [e for e in needed if not prom.query(e)]
        if not missing:
            time.sleep(3.0)  # a few more scrapes and rule evaluations
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"no data after {timeout} s: {missing}")
        time.sleep(1.0)


def test_promtool_accepts_the_rules_file() -> None:
    r = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(load_rules())} rules found" in r.stdout


def test_prometheus_loads_every_rule_and_evaluates_it_healthily(prometheus: Prometheus) -> None:
    want = {r.get("record") or r.get("alert") for r in load_rules()}
    deadline = time.monotonic() + 30
    while True:
        groups = prometheus.get("/api/v1/rules")["groups"]
        loaded = {r["name"]: r for g in groups for r in g["rules"]}
        evaluated = all(r.get("lastEvaluation", "").startswith("20") for r in loaded.values())
        if evaluated or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert set(loaded) == want
    bad = {n: r.get("lastError") for n, r in loaded.items() if r["health"] != "ok"}
    assert not bad, bad


@pytest.mark.parametrize("q", dashboard_queries(), ids=lambda q: q.source)
def test_every_panel_query_has_data_under_traffic_and_never_nan(
    q: Query, prometheus: Prometheus
) -> None:
    """Every query of every panel, but those of the "Real vLLM only" panels (empty in
    front of simulated pods) and the "P/D fleets only" ones (the stack has no roles)."""
    result = prometheus.query(filled(q))
    if real_vllm_only(q):
        assert result == [], "the sim exports it now: drop the 'Real vLLM only' note"
        return
    if pd_only(q):  # no split request on a fleet without roles
        assert result == [], f"{q.source}: data without P/D pods: {result}"
        return
    assert result, f"{q.source}: no data for {filled(q)}"
    assert all(s["value"][1] != "NaN" for s in result), (q.source, result)


@pytest.mark.parametrize("q", dashboard_queries(), ids=lambda q: q.source)
def test_idle_a_ratio_or_quantile_has_no_value_and_everything_else_has_data(
    q: Query, prometheus: Prometheus
) -> None:
    """In a window without requests a ratio is 0/0 and a quantile has no observation:
    no value (a stat says "no traffic"), never NaN.  Counters and gauges still show,
    those that never moved as 0 ("No data" only where nothing is exported)."""
    result = prometheus.query(filled(q), at=prometheus.idle_at)
    if real_vllm_only(q) or pd_only(q):
        assert result == []
    elif is_ratio_or_quantile(parse(q)):
        assert result == [], f"{q.source}: {result}"
    else:
        assert result, f"{q.source}: 'No data' on an idle stack for {filled(q)}"
        assert all(s["value"][1] != "NaN" for s in result), (q.source, result)


@pytest.mark.parametrize("when", ["idle", "busy"])
def test_failure_panels_draw_one_zero_line_per_query_not_one_per_pod(
    when: str, prometheus: Prometheus
) -> None:
    at = prometheus.idle_at if when == "idle" else None
    checked = 0
    for q in dashboard_queries():
        if not filters_zeros_then_falls_back(parse(q)):
            continue
        checked += 1
        values = [float(s["value"][1]) for s in prometheus.query(filled(q), at=at)]
        assert values, q.source
        assert values == [0.0] or 0.0 not in values, (q.source, values)
    assert checked >= 15


def test_healthy_pods_counts_each_pod_once_with_two_router_replicas(
    prometheus: Prometheus,
) -> None:
    # the rig: both replicas report all four pods (a plain sum would read 6 / 8)
    per_replica = f'count by (instance) (kvroute_pod_healthy{{namespace="{ROUTER_NAMESPACE}"}})'
    assert [s["value"][1] for s in prometheus.query(per_replica)] == ["4"] * ROUTERS
    panel = next(
        p
        for p in load_dashboards()["kvroute-overview.json"]["panels"]
        if p["title"] == "Healthy pods"
    )
    read = {}
    for t in panel["targets"]:
        expr = substitute(t["expr"], template_values("kvroute-overview.json"))
        [series] = prometheus.query(expr)
        read[t["legendFormat"]] = series["value"][1]
    # dead-0 is ejected by both replicas
    assert read == {"healthy": "3", "known": "4"}


@pytest.mark.parametrize("q", dashboard_queries(), ids=lambda q: q.source)
def test_a_dashboard_pointed_where_no_router_or_pod_is_shows_no_data_not_zeros(
    q: Query, prometheus: Prometheus
) -> None:
    nowhere = {"namespace": "nowhere", "router_namespace": "nowhere"}
    assert q.dashboard is not None
    expr = substitute(q.expr, {**template_values(q.dashboard), **nowhere})
    assert prometheus.query(expr) == [], q.source


def short_windows(expr: str) -> str:
    """``expr`` with every range (``[5m]``, ``[10m]``) cut to 30 s: the test has seconds of
    data, and rate() over a window mostly empty divides by the whole window."""
    return re.sub(r"\[\d+[smh]\]", "[30s]", expr)


@pytest.mark.parametrize("q", rule_queries(), ids=lambda q: q.source)
def test_every_rule_expression_runs_and_recording_rules_have_data(
    q: Query, prometheus: Prometheus
) -> None:
    assert q.rule is not None
    result = prometheus.query(q.expr)
    if "record" in q.rule:
        assert result, f"{q.source}: no data"
        namespace = NAMESPACE if "vllm:" in q.expr else ROUTER_NAMESPACE
        for series in result:
            assert series["metric"].get("namespace") == namespace, series
        return
    result = prometheus.query(short_windows(q.expr))
    if q.rule["alert"] in ALERTS_FIRING:
        pods = {s["metric"].get("pod") for s in result}
        assert pods == {ALERTS_FIRING[q.rule["alert"]]}, result
    elif q.rule["alert"] in ALERTS_QUIET:
        assert result == [], result


def test_every_alert_is_expected_either_to_fire_or_to_stay_quiet_or_is_named_here() -> None:
    alerts = {r["alert"] for r in load_rules() if "alert" in r}
    # upstream errors depend on whether a request reached dead-0 before its ejection; the
    # index drift over the test's short windows on whether back-to-back turns raced their
    # predecessors' events (seen on quiet-0 and on sim-1 in different runs)
    assert alerts - ALERTS_FIRING.keys() - ALERTS_QUIET == {
        "KvroutePodUpstreamErrors",
        "KvrouteIndexDrift",
    }


@pytest.mark.parametrize("name", ["kvroute-overview.json", "kvroute-fleet.json"])
def test_every_template_variable_lists_values(name: str, prometheus: Prometheus) -> None:
    for var in load_dashboards()[name]["templating"]["list"]:
        if var["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["query"]["query"])
        assert m, var["name"]
        match = substitute(m.group(1), template_values(name))
        values = prometheus.get(f"/api/v1/label/{m.group(2)}/values", **{"match[]": match})
        assert values, f"{name}: variable {var['name']} has no values"
        if var["name"] in ("namespace", "router_namespace"):
            assert values == [template_values(name)[var["name"]]], var["name"]
        if var["name"] == "model":
            assert values == [MODEL]
