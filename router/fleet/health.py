"""Health checks: eject a failing pod, re-admit it when it answers again.

Every ``interval_s`` each pod gets ``GET {url}{path}`` (vLLM: ``/health``) with a
``timeout_s`` deadline.  A 2xx answer is a success; anything else (error status,
refused connection, timeout) a failure.  After ``failure_threshold`` consecutive
failures the pod is ejected (``PodRegistry.set_healthy(state, False)``: no request goes
there, and the proxy fails over the requests still waiting on it); the first success
re-admits it.  On success the pod's served models are refreshed
from ``GET {url}/v1/models`` (the ``id`` of every entry: base model and LoRA
adapters): ``PodState.models = spec.models | ids``.

**Panic threshold** (Envoy's ``healthy_panic_threshold``, whose default, 50%, is ours).
A timeout says less than a refusal: when every pod of a model times out at once, the
likelier cause is the router's side (its event loop or host starved, a network
hiccup) or a fleet-wide slowdown, and ejecting them all turns a slow fleet into a dead
one (every request a 503 "no healthy pod").  So a pod whose consecutive failures are
*all timeouts* is only *suspect*; it is ejected only while at least
``panic_threshold_pct`` percent of the pods of each model it serves stay healthy
without it (pods neither ejected nor suspect).  When fewer would, the model is in
**panic**: its suspect pods are kept in rotation (re-admitted if ejected earlier), and
requests go to all of them rather than to none; a hung one then costs a request its
first-byte deadline and one failover (streams) or its read timeout (non-streaming), a
clean 504 either way.  A refused connection or an error status is an explicit failure:
such a pod is ejected whatever the threshold, and is not counted as healthy.  The
panic ends as soon as enough pods answer again; its suspects are then ejected.  0
disables it (every pod may be ejected).  ``kvroute_health_panic{model}`` is 1 while a
model is in panic.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections import defaultdict
from collections.abc import Callable, Iterator

import httpx
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry
from pydantic import BaseModel, ConfigDict, Field

from router.fleet.pods import PodRegistry, PodState
from router.logs import RateLimitedLog

log = logging.getLogger(__name__)


class HealthSettings(BaseModel):
    """Pod health checks (nested as ``health`` in the router's config)."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(True, description="run periodic health checks")
    interval_s: float = Field(5.0, gt=0, description="seconds between checks of all pods")
    timeout_s: float = Field(2.0, gt=0, description="deadline of one check")
    failure_threshold: int = Field(3, ge=1, description="consecutive failures that eject")
    panic_threshold_pct: float = Field(
        50.0,
        ge=0,
        le=100,
        description="pods failing on timeouts alone are ejected only while at least this "
        "percentage of their model's pods stay healthy; below, all of them keep receiving "
        "requests (a panic, as Envoy's; refused or erroring pods are ejected anyway); 0: off",
    )
    path: str = Field("/health", description="health endpoint of a pod")
    refresh_models: bool = Field(True, description="learn served models from /v1/models")
    models_path: str = Field("/v1/models", description="served models endpoint of a pod")


class HealthChecker:
    """Checks every pod in ``registry``; ``run()`` loops, ``check_all()`` is one round."""

    def __init__(
        self,
        registry: PodRegistry,
        settings: HealthSettings,
        *,
        client: httpx.AsyncClient | None = None,
        metrics_registry: CollectorRegistry | None = None,
        tls: Callable[[], ssl.SSLContext] | None = None,
    ) -> None:
        """``tls``: the TLS context of https pods (the router's one, ``PodTLS.context``)
        for the client made here; default: httpx's (certifi's CAs)."""
        self.registry = registry
        self.settings = settings
        self._client = client
        self._tls = tls
        self._own_client = client is None
        self.checks: dict[str, int] = defaultdict(int)
        self.failures: dict[str, int] = defaultdict(int)
        self.ejections: dict[str, int] = defaultdict(int)
        self.readmissions: dict[str, int] = defaultdict(int)
        #: why the last failed check of each pod failed
        self.last_problem: dict[str, str] = {}
        #: pods past ``failure_threshold`` whose consecutive failures were all timeouts
        #: (ejected unless their model is in panic)
        self.suspects: set[str] = set()
        #: models in panic now (their suspect pods are kept in rotation)
        self.panic: set[str] = set()
        self._timeouts_only: dict[str, bool] = {}
        #: (pod, model) pairs configured for a pod that its /v1/models does not list
        #: (warned once each: a typo in ``models:`` would be advertised, never served)
        self.unserved: set[tuple[str, str]] = set()
        self._log = RateLimitedLog(log)  # one line per pod and cause per 10 s
        if metrics_registry is not None:
            metrics_registry.register(_HealthCollector(self))

    @property
    def client(self) -> httpx.AsyncClient:
        if self._client is None:
            verify: ssl.SSLContext | bool = self._tls() if self._tls is not None else True
            self._client = httpx.AsyncClient(timeout=self.settings.timeout_s, verify=verify)
        return self._client

    async def aclose(self) -> None:
        if self._own_client and self._client is not None:
            await self._client.aclose()
            self._client = None

    async def check_all(self) -> None:
        """One round: every pod checked at once; the panic threshold applied when all
        have answered (so a fleet timing out together is seen together)."""
        await asyncio.gather(*(self.check(p, rebalance=False) for p in self.registry.all()))
        self._rebalance()

    async def _probe(self, state: PodState) -> tuple[str, bool] | None:
        """None when healthy, else (why not, whether it was a timeout)."""
        url = state.spec.url + self.settings.path
        try:
            r = await self.client.get(url, timeout=self.settings.timeout_s)
        except Exception as exc:  # refused, timeout, bad URL...: all mean "not healthy"
            why = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            return why, isinstance(exc, httpx.TimeoutException)
        if not r.is_success:
            return f"HTTP {r.status_code}", False
        return None

    async def _models(self, state: PodState) -> set[str] | None:
        url = state.spec.url + self.settings.models_path
        try:
            r = await self.client.get(url, timeout=self.settings.timeout_s)
            r.raise_for_status()
            data = r.json().get("data")
            return {str(m["id"]) for m in data if isinstance(m, dict) and m.get("id")}
        except Exception as exc:  # unreachable, not JSON, not {"data": [...]}
            state.problem = f"cannot read {self.settings.models_path}: {exc}"
            self._log.warning(
                ("models", state.name), "health: %s: cannot read %s: %s", state.name, url, exc
            )
            return None

    async def check(self, state: PodState, *, rebalance: bool = True) -> bool:
        """One check of one pod; updates its state (and, with ``rebalance``, applies
        the panic threshold); True when healthy."""
        name = state.name
        self.checks[name] += 1
        failed = await self._probe(state)
        if failed is not None:
            problem, timeout = failed
            self.failures[name] += 1
            self.last_problem[name] = state.problem = problem
            state.consecutive_failures += 1
            first = state.consecutive_failures == 1
            only = self._timeouts_only[name] = timeout and (
                first or self._timeouts_only.get(name, True)
            )
            if state.consecutive_failures >= self.settings.failure_threshold:
                if only and self.settings.panic_threshold_pct > 0:
                    self.suspects.add(name)
                else:
                    self.suspects.discard(name)
                    self._eject(state, problem)
            if rebalance:
                self._rebalance()
            return False
        state.consecutive_failures = 0
        state.problem = None
        self._timeouts_only.pop(name, None)
        self.suspects.discard(name)
        if not state.healthy:
            self.registry.set_healthy(state, True)
            self.readmissions[name] += 1
            log.info("health: %s re-admitted", name)
        if rebalance:
            self._rebalance()
        if self.settings.refresh_models:
            ids = await self._models(state)
            if ids is not None:
                state.models = set(state.spec.models) | ids
                self._check_configured(state, ids)
        return True

    def _eject(self, state: PodState, problem: str) -> None:
        if not state.healthy:
            return
        self.registry.set_healthy(state, False)
        self.ejections[state.name] += 1
        log.warning(
            "health: %s ejected after %d failures (%s)",
            state.name,
            state.consecutive_failures,
            problem,
        )

    def _rebalance(self) -> None:
        """Apply the panic threshold: eject the suspects of models that can spare them,
        keep (or put back) in rotation those of models in panic."""
        pods = self.registry.all()
        names = {p.name for p in pods}
        self.suspects &= names
        for gone in [n for n in self._timeouts_only if n not in names]:
            del self._timeouts_only[gone]
        pct = self.settings.panic_threshold_pct
        panic: set[str] = set()
        if self.suspects:
            models = {m for p in pods if p.name in self.suspects for m in p.models}
            for model in models:
                serving = [p for p in pods if model in p.models]
                fine = sum(1 for p in serving if p.healthy and p.name not in self.suspects)
                if fine * 100 < pct * len(serving):
                    panic.add(model)
        for model in sorted(panic - self.panic):
            self._log.warning(
                ("panic", model),
                "health: %s: fewer than %g%% of its pods answer health checks (the others "
                "time out): panic, requests go to all of them rather than none (%s)",
                model,
                pct,
                ", ".join(sorted(p.name for p in pods if model in p.models)),
            )
        for model in sorted(self.panic - panic):
            log.info("health: %s: panic over", model)
        self.panic = panic
        for p in pods:
            if p.name not in self.suspects:
                continue
            if p.models & panic:
                if not p.healthy:
                    self.registry.set_healthy(p, True)
                    self.readmissions[p.name] += 1
            else:
                self._eject(p, self.last_problem.get(p.name, "timeouts"))

    def _check_configured(self, state: PodState, ids: set[str]) -> None:
        for model in state.spec.models:
            key = (state.name, model)
            if model not in ids and key not in self.unserved:
                self.unserved.add(key)
                log.warning(
                    "health: pod %s is configured to serve %r but its %s lists only %s: "
                    "check the pod's models: setting (a typo is advertised, never served)",
                    state.name,
                    model,
                    self.settings.models_path,
                    ", ".join(sorted(ids)) or "nothing",
                )

    async def run(self) -> None:
        try:
            while True:
                await self.check_all()
                await asyncio.sleep(self.settings.interval_s)
        finally:
            with contextlib.suppress(Exception):
                await self.aclose()


class _HealthCollector(Collector):
    def __init__(self, checker: HealthChecker) -> None:
        self._c = checker

    def collect(self) -> Iterator[Metric]:
        healthy = GaugeMetricFamily(
            "kvroute_pod_healthy", "1 when the pod receives requests", labels=["pod"]
        )
        for p in self._c.registry.all():
            healthy.add_metric([p.name], 1.0 if p.healthy else 0.0)
        yield healthy
        panic = GaugeMetricFamily(
            "kvroute_health_panic",
            "1 while fewer than health.panic_threshold_pct of the model's pods answer health "
            "checks and its pods that time out are kept in rotation",
            labels=["model"],
        )
        models = {m for p in self._c.registry.all() for m in p.models}
        for m in sorted(models | self._c.panic):
            panic.add_metric([m], 1.0 if m in self._c.panic else 0.0)
        yield panic
        for attr, doc in (
            ("failures", "failed health checks"),
            ("ejections", "times a pod was ejected by health checks"),
            ("readmissions", "times an ejected pod was re-admitted"),
        ):
            fam = CounterMetricFamily(f"kvroute_health_{attr}", doc, labels=["pod"])
            for pod, n in getattr(self._c, attr).items():
                fam.add_metric([pod], n)
            yield fam
