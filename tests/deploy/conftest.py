"""A real kvroute stack on 127.0.0.1 for the dashboard and rule tests.

``kvroute_stack`` (module-scoped) starts, as subprocesses:

* three ``kvroute sim`` pods: ``sim-0`` and ``sim-1`` publish KV events, ``quiet-0`` does
  not (``--no-kv-events``: it gets traffic while the index holds nothing for it);
* ``kvroute serve`` with ``--discovery.static`` naming those three plus ``dead-0``, a pod
  whose URL nobody listens on (it fails scrapes and health checks and is ejected);
  ``running_stack(routers=2)`` starts two such routers, replicas that share nothing but
  the pods (each its own index, health checks and scrapes);

with tenants (:data:`TENANTS`: ``team-a`` and ``team-b`` unlimited, ``capped`` at two
requests a minute; ``/metrics`` open, as a Prometheus-only network would have it), then
sends chat completions through the router, alternately as ``team-a`` and ``team-b``.
Every process is stopped by PID at the end, whatever happens.  The repository root is
put first on ``PYTHONPATH`` so the subprocesses run this checkout's code.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MODEL = "sim-model"
DASHBOARDS = ROOT / "helm" / "kvroute" / "dashboards"
RULES = ROOT / "helm" / "kvroute" / "rules" / "kvroute-rules.yaml"
#: the namespaces the live test's Prometheus puts on the vLLM pods and on the routers (a
#: router often runs in a namespace of its own)
NAMESPACE = "kvroute-test"
ROUTER_NAMESPACE = "kvroute-router"
#: the values the tests give the dashboards' template variables: every variable is
#: multi-valued with "All" = ".*"; $__rate_interval is 4 x the 1 s scrape interval of
#: the live test, widened to ride out a busy 2-core machine
TEMPLATE_VALUES = {
    "__rate_interval": "20s",
    "__interval": "5s",
    "__range": "5m",
    "namespace": NAMESPACE,
    "router_namespace": ROUTER_NAMESPACE,
    "job": ".*",
    "pod": ".*",
    "model": ".*",
}
#: the routers' tenants (name -> key): the traffic of the Tenants row
TENANT_KEYS = {
    "team-a": "deploy-test-key-team-a-0123",
    "team-b": "deploy-test-key-team-b-0123",
    "capped": "deploy-test-key-capped-0123",
}
#: ``capped`` gets 429s once the live test's traffic has sent it a few requests
TENANTS = [
    {"name": name, "key_sha256": hashlib.sha256(key.encode()).hexdigest()}
    | ({"limits": {"requests_per_minute": 2}} if name == "capped" else {})
    for name, key in TENANT_KEYS.items()
]
TENANCY = {
    "tenants": TENANTS,
    "tenant_salt_secret": "deploy-test-salt-secret-0123456789abcdef",
    "security": {"metrics_endpoint": "open"},
}


def tenant_auth(tenant: str) -> dict[str, str]:
    return {"authorization": f"Bearer {TENANT_KEYS[tenant]}"}


#: the overview is the router's dashboard: its $namespace is the router's
DASHBOARD_VALUES = {"kvroute-overview.json": {"namespace": ROUTER_NAMESPACE}}


def template_values(dashboard: str) -> dict[str, str]:
    """:data:`TEMPLATE_VALUES` as ``dashboard`` (a file name) is filled in the live test."""
    return {**TEMPLATE_VALUES, **DASHBOARD_VALUES.get(dashboard, {})}


@dataclass(frozen=True)
class Query:
    """One PromQL expression of a dashboard panel or a rule."""

    source: str  # "kvroute-overview.json: panel 3 'Errors / s by reason' A"
    expr: str  # as written (template variables unsubstituted)
    panel: dict[str, Any] | None = None  # the panel, for dashboard queries
    rule: dict[str, Any] | None = None  # the rule, for rule queries

    @property
    def dashboard(self) -> str | None:
        """The dashboard's file name, for dashboard queries."""
        return self.source.split(":")[0] if self.panel is not None else None


def load_dashboards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def load_rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [rule for group in doc["groups"] for rule in group["rules"]]


def panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' collapsed children included."""
    for p in dashboard["panels"]:
        yield p
        yield from p.get("panels", [])


def dashboard_queries() -> list[Query]:
    out = []
    for name, dash in load_dashboards().items():
        for p in panels(dash):
            for t in p.get("targets", []):
                src = f"{name}: panel {p['id']} {p['title']!r} {t['refId']}"
                out.append(Query(src, t["expr"], panel=p))
    return out


def rule_queries() -> list[Query]:
    out = []
    for r in load_rules():
        name = r.get("record") or r.get("alert")
        out.append(Query(f"kvroute-rules.yaml: {name}", str(r["expr"]), rule=r))
    return out


def substitute(expr: str, values: dict[str, str] | None = None) -> str:
    """``expr`` with Grafana's ``$var`` / ``${var}`` replaced (longest names first)."""
    values = TEMPLATE_VALUES if values is None else values
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace("${" + name + "}", values[name]).replace("$" + name, values[name])
    if "$" in expr:
        raise AssertionError(f"unsubstituted template variable in {expr!r}")
    return expr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Stop one process we started, by PID: SIGTERM, then SIGKILL after 10 s."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            with contextlib.suppress(Exception):
                stream.close()


def first_line(proc: subprocess.Popen[bytes], timeout: float) -> str:
    """The first stdout line of ``proc`` (``kvroute sim`` prints its endpoints there)."""
    assert proc.stdout is not None
    out: queue.Queue[bytes] = queue.Queue()
    stdout = proc.stdout
    threading.Thread(target=lambda: out.put(stdout.readline()), daemon=True).start()
    try:
        line = out.get(timeout=timeout)
    except queue.Empty:
        raise AssertionError(f"no line from {proc.args!r} within {timeout} s") from None
    if not line:
        raise AssertionError(f"{proc.args!r} exited with {proc.wait()}")
    return line.decode()


def wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} not answering after {timeout} s")
        time.sleep(0.2)


@dataclass
class Stack:
    #: base URL of each router replica (all route to the same pods)
    router_urls: list[str]
    #: pod name -> base URL of each simulated pod we started
    sims: dict[str, str]
    dead_pod: str
    quiet_pod: str
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def router_url(self) -> str:
        """The first router replica."""
        return self.router_urls[0]

    def chat(self, i: int, router: str | None = None, tenant: str | None = None) -> int:
        """One completion: even ``i`` chat with one of three long system prompts (prefix
        hits), odd ``i`` are text completions starting with text of their own (a miss on
        every pod, which the policy spreads by its tie-break: every live pod gets some);
        as ``tenant`` (default: ``team-a`` and ``team-b`` by turns of two, so both chat)."""
        if i % 2 == 0:
            system = f"You are assistant number {i % 3}. " + "Answer briefly and precisely. " * 8
            messages = [
                {"role": "system", "content": system},
                {"role": "user", "content": f"question {i}: what is {i} plus {i}?"},
            ]
            path = "/v1/chat/completions"
            body = {"model": MODEL, "messages": messages, "max_tokens": 4, "stream": i % 4 == 0}
        else:
            path = "/v1/completions"
            body = {
                "model": MODEL,
                "prompt": f"{i * 7919} {i} is a prompt of its own",
                "max_tokens": 4,
            }
        who = tenant or ("team-a", "team-b")[i // 2 % 2]
        r = httpx.post(
            f"{router or self.router_url}{path}", json=body, headers=tenant_auth(who), timeout=30.0
        )
        return r.status_code

    def traffic(self, n: int, router: str | None = None) -> list[int]:
        return [self.chat(i, router) for i in range(n)]


def start_sim(name: str, *extra: str) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    cmd = [
        sys.executable, "-m", "router.cli", "sim", "--port", "0", "--pod-name", name,
        "--model", MODEL, "--kv-endpoint", "tcp://127.0.0.1:0",
        "--replay-endpoint", "tcp://127.0.0.1:0", "--time-scale", "0", *extra,
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=child_env(), cwd=ROOT
    )
    try:
        return proc, json.loads(first_line(proc, timeout=60))
    except BaseException:
        stop(proc)
        raise


@contextlib.contextmanager
def running_stack(routers: int = 1) -> Iterator[Stack]:
    procs: list[subprocess.Popen[bytes]] = []
    cleanup: list[Path] = []
    try:
        static = []
        sims = {}
        for name, extra in (("sim-0", ()), ("sim-1", ()), ("quiet-0", ("--no-kv-events",))):
            proc, info = start_sim(name, *extra)
            procs.append(proc)
            sims[name] = info["url"]
            pod = {"name": name, "url": info["url"], "models": [MODEL]}
            if info.get("events_endpoint"):
                pod["events_endpoint"] = info["events_endpoint"]
                pod["replay_endpoint"] = info["replay_endpoint"]
            static.append(pod)
        static.append(
            {"name": "dead-0", "url": f"http://127.0.0.1:{free_port()}", "models": [MODEL]}
        )
        urls = []
        fd, config_path = tempfile.mkstemp(prefix="kvroute-stack-", suffix=".yaml")
        with os.fdopen(fd, "w") as config:
            yaml.safe_dump(TENANCY, config)
        cleanup.append(Path(config_path))
        for _ in range(routers):
            port = free_port()
            cmd = [
                sys.executable, "-m", "router.cli", "serve", "--config", config_path,
                "--host", "127.0.0.1",
                "--port", str(port), "--discovery.static", json.dumps(static),
                "--health.interval-s", "0.5", "--health.failure-threshold", "2",
                "--log-level", "warning",
            ]  # fmt: skip
            procs.append(
                subprocess.Popen(
                    cmd,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    env=child_env(),
                    cwd=ROOT,
                )
            )
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:
            wait_http(f"{url}/metrics", timeout=60)
        yield Stack(urls, sims, dead_pod="dead-0", quiet_pod="quiet-0", procs=procs)
    finally:
        for proc in reversed(procs):
            stop(proc)
        for path in cleanup:
            path.unlink(missing_ok=True)


@contextlib.contextmanager
def warm_stack(routers: int = 1) -> Iterator[Stack]:
    """:func:`running_stack`, the dead pod ejected and 24 completions sent through each
    router replica."""
    with running_stack(routers) as stack:
        # let the dead pod be ejected first, so traffic reaches live pods only
        time.sleep(2.0)
        for url in stack.router_urls:
            statuses = stack.traffic(24, router=url)
            assert statuses.count(200) == len(statuses), (url, statuses)
        yield stack


@pytest.fixture(scope="module")
def kvroute_stack() -> Iterator[Stack]:
    with warm_stack() as stack:
        yield stack


@pytest.fixture
def no_kvroute_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings reads KVROUTE_* from the environment: start from none."""
    for name in list(os.environ):
        if name.startswith("KVROUTE_"):
            monkeypatch.delenv(name)
