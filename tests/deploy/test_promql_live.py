"""Every dashboard query and every rule, evaluated by a real Prometheus scraping kvroute.

Opt-in (``python3 -m pytest -m prometheus tests/deploy``); skipped when no ``prometheus``
binary is on PATH (Debian: ``apt-get install prometheus``).  The stack of conftest.py
(``kvroute serve`` in front of ``sim-0``, ``sim-1``, ``quiet-0`` without KV events, and
``dead-0`` that nobody serves) is scraped every second by a Prometheus started here on
127.0.0.1 with the rules file loaded, while a background thread keeps chat completions
flowing.  The scrape config mirrors Kubernetes: ``namespace`` on every target, the vLLM
pods' ``pod`` as a target label, the router scraped with ``honor_labels`` (its series
carry ``pod`` = the vLLM pod a request went to).
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
    wait_http,
)

pytestmark = [
    pytest.mark.prometheus,
    pytest.mark.skipif(shutil.which("prometheus") is None, reason="no prometheus binary on PATH"),
]

NAMESPACE = TEMPLATE_VALUES["namespace"]
#: panels that must show data once traffic flows through the stack
PANELS_WITH_DATA = {
    "kvroute-overview.json": {
        "Requests / s by status",
        "Requests / s by model and policy",
        "Errors / s by reason",  # the traffic includes requests for an unknown model
        "5xx ratio",
        "Routing decision latency (router-added work)",
        "Tokenization latency by tokenizer",
        "TTFT measured at the router",
        "Routed hit rate",
        "Routed hit rate by pod",
        "Request share by pod",
        "In-flight requests by pod",
        "Prompt tokens / s by pod",
        "Index entries by pod",
        "KV events ingested / s",
        "Gaps, missed batches, replays",
        "KV event errors",
        "Event lag and queue depth",
        "Healthy pods",
        "Pod health",
        "Scrape errors / s by pod",  # dead-0
        "Health checks",  # dead-0
        "Responses: follow-ups by owner lookup",
        "Responses: routed without a cache score",
    },
    "kvroute-fleet.json": {
        "Fleet prefix-cache hit rate",
        "Prefix-cache hit rate by pod",
        "Measured vs routed hit rate",
        "KV cache usage by pod",
        "Requests waiting / running by pod",
        "Prompt / generation tokens / s by pod",
        "Finished requests / s by reason",
        "TTFT",
        "TTFT p90 by pod",
        "Queue time p90 by pod",
        "End-to-end latency",
        "Cache configuration",
    },
}
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
    """Chat completions through the router from a thread, until stopped; every 10th asks
    for a model nobody serves (a 404 counted in kvroute_bad_requests_total); every 10th
    is a Responses API round: a response (with a function-call item: unscored), a
    follow-up naming it (its owner is known) and one naming a response nobody stored."""

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
                if i % 10 == 9:
                    messages = [{"role": "user", "content": "x"}]
                    body = {"model": "no-such-model", "messages": messages}
                    r = client.post(f"{self.stack.router_url}/v1/chat/completions", json=body)
                    status = r.status_code
                elif i % 10 == 4:
                    status = self._responses(client, i)
                else:
                    status = self.stack.chat(1000 + i)
                self.statuses[status] = self.statuses.get(status, 0) + 1
                self.sent += 1
                self._stop.wait(0.1)

    def _responses(self, client: httpx.Client, i: int) -> int:
        url = f"{self.stack.router_url}/v1/responses"
        call = {"type": "function_call", "call_id": f"c{i}", "name": "f", "arguments": "{}"}
        first = client.post(url, json={"model": MODEL, "input": [call], "max_output_tokens": 4})
        if first.status_code != 200:
            return first.status_code
        follow = {"model": MODEL, "input": "and then?", "max_output_tokens": 4}
        known = client.post(url, json={**follow, "previous_response_id": first.json()["id"]})
        client.post(url, json={**follow, "previous_response_id": f"resp_never_stored_{i}"})
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

    def get(self, path: str, **params: Any) -> Any:
        r = httpx.get(f"{self.url}{path}", params=params, timeout=30.0)
        body = r.json()
        assert body["status"] == "success", f"{path} {params}: {body}"
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.get("/api/v1/query", query=expr)
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
                    {"targets": [target(stack.router_url)], "labels": {"namespace": NAMESPACE}}
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
        with Traffic(kvroute_stack) as traffic:
            wait_for_data(prom, kvroute_stack)
            yield prom
        assert traffic.statuses.get(200, 0) > 0, traffic.statuses
    finally:
        stop(proc)
        log.close()


def wait_for_data(prom: Prometheus, stack: Stack, timeout: float = 90.0) -> None:
    """Until every target is up and the rates the panels use have two samples each."""
    window = TEMPLATE_VALUES["__rate_interval"]
    needed = (
        "sum(up) == 4",
        f"sum(rate(kvroute_requests_total[{window}])) > 0",
        f'rate(kvroute_requests_total{{pod="{stack.quiet_pod}"}}[1m]) > 0',
        f"rate(vllm:prefix_cache_hits_total[{window}]) > 0",
        f"rate(kvroute_bad_requests_total[{window}]) > 0",
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
def test_every_panel_query_runs_and_the_essential_ones_have_data(
    q: Query, prometheus: Prometheus
) -> None:
    assert q.panel is not None
    result = prometheus.query(substitute(q.expr))
    dashboard = q.source.split(":")[0]
    description = str(q.panel["description"])
    if description.startswith("Real vLLM only"):
        assert result == [], "the sim exports it now: drop the 'Real vLLM only' note"
    elif q.panel["title"] in PANELS_WITH_DATA[dashboard] and q.source.endswith(" A"):
        # a panel's first query (refId A) carries its main signal
        assert result, f"{q.source}: no data for {substitute(q.expr)}"


def test_every_panel_named_to_have_data_exists() -> None:
    titles = {
        name: {p["title"] for p in d["panels"] if p["type"] != "row"}
        for name, d in load_dashboards().items()
    }
    for name, want in PANELS_WITH_DATA.items():
        assert want <= titles[name], want - titles[name]


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
        for series in result:
            assert series["metric"].get("namespace") == NAMESPACE, series
        return
    result = prometheus.query(short_windows(q.expr))
    if q.rule["alert"] in ALERTS_FIRING:
        pods = {s["metric"].get("pod") for s in result}
        assert pods == {ALERTS_FIRING[q.rule["alert"]]}, result
    elif q.rule["alert"] in ALERTS_QUIET:
        assert result == [], result


def test_every_alert_is_expected_either_to_fire_or_to_stay_quiet_or_is_named_here() -> None:
    alerts = {r["alert"] for r in load_rules() if "alert" in r}
    # upstream errors depend on whether a request reached dead-0 before its ejection
    assert alerts - ALERTS_FIRING.keys() - ALERTS_QUIET == {"KvroutePodUpstreamErrors"}


@pytest.mark.parametrize("name", ["kvroute-overview.json", "kvroute-fleet.json"])
def test_every_template_variable_lists_values(name: str, prometheus: Prometheus) -> None:
    for var in load_dashboards()[name]["templating"]["list"]:
        if var["type"] != "query":
            continue
        m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["query"]["query"])
        assert m, var["name"]
        values = prometheus.get(
            f"/api/v1/label/{m.group(2)}/values", **{"match[]": substitute(m.group(1))}
        )
        assert values, f"{name}: variable {var['name']} has no values"
        if var["name"] == "namespace":
            assert values == [NAMESPACE]
        if var["name"] == "model":
            assert values == [MODEL]
