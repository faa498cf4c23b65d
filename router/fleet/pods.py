"""The fleet as the router sees it: pod specs from discovery, and live state per pod.

Discovery (static list, DNS, Kubernetes) produces :class:`PodSpec` sets and calls
:meth:`PodRegistry.set_pods`; the registry diffs them and tells its listeners (the
KV-event subscriber, the metrics scraper, the index cleaner) which pods came and went.
Health checks flip :attr:`PodState.healthy`.  The request path reads
:meth:`PodRegistry.candidates`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from router.fleet.roles import Role
from router.logs import RateLimitedLog

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PodSpec:
    """How to reach one pod."""

    name: str
    #: HTTP base URL of the pod's OpenAI server, e.g. "http://10.0.0.7:8000"
    url: str
    #: ZMQ endpoint of the pod's KV-event publisher to dial (None: the pod connects to
    #: our bound SUB socket, or publishes no events)
    events_endpoint: str | None = None
    #: ZMQ ROUTER endpoint serving replays of recent batches (None: no replay)
    replay_endpoint: str | None = None
    #: models the pod serves, if known up front (else learned from GET /v1/models)
    models: tuple[str, ...] = ()
    #: prefill/decode role for every model not in ``roles`` (router.fleet.roles)
    role: Role = "both"
    #: per-model roles, ``((model, role), ...)`` sorted by model
    roles: tuple[tuple[str, Role], ...] = ()

    def role_for(self, model: str) -> Role:
        """This pod's role for ``model`` (a base model or LoRA adapter name)."""
        for name, role in self.roles:
            if name == model:
                return role
        return self.role


@dataclass(slots=True)
class PodState:
    spec: PodSpec
    healthy: bool = True
    #: served model names and LoRA adapters, learned from /v1/models (or the spec)
    models: set[str] = field(default_factory=set)
    consecutive_failures: int = 0
    #: why the last health check failed, or why its models are unknown (None: fine)
    problem: str | None = None

    @property
    def name(self) -> str:
        return self.spec.name

    def role_for(self, model: str) -> Role:
        return self.spec.role_for(model)


PodListener = Callable[[str, PodSpec | None], None]
"""Called with (pod name, spec) when a pod is added or changed, (name, None) when removed."""

HealthListener = Callable[[str, bool], None]
"""Called with (pod name, healthy) when health checks eject or re-admit a pod."""


class PodRegistry:
    def __init__(self) -> None:
        self._pods: dict[str, PodState] = {}
        self._listeners: list[PodListener] = []
        self._health_listeners: list[HealthListener] = []
        #: bumped by every change of the fleet (a pod added, changed or removed)
        self.version = 0
        self._log = RateLimitedLog(log)

    def subscribe(self, listener: PodListener) -> None:
        self._listeners.append(listener)
        for name, state in self._pods.items():
            listener(name, state.spec)

    def subscribe_health(self, listener: HealthListener) -> None:
        """Hear of every ejection and re-admission made through :meth:`set_healthy`."""
        self._health_listeners.append(listener)

    def set_healthy(self, state: PodState, healthy: bool) -> None:
        """Eject (``False``) or re-admit ``state``'s pod and tell the health listeners
        (the proxy fails over the requests still waiting on an ejected pod)."""
        if state.healthy == healthy:
            return
        state.healthy = healthy
        for listener in self._health_listeners:
            try:
                listener(state.name, healthy)
            except Exception:  # a listener's bug must not stop health checks
                self._log.exception(
                    ("health_listener", listener), "health listener failed for %s", state.name
                )

    def _notify(self, name: str, spec: PodSpec | None) -> None:
        for listener in self._listeners:
            try:
                listener(name, spec)
            except Exception:  # a listener's bug must not stop discovery
                self._log.exception(("listener", listener), "pod listener failed for %s", name)

    def set_pods(self, specs: Iterable[PodSpec]) -> tuple[list[str], list[str]]:
        """Replace the fleet with ``specs``; returns (added or changed, removed) names."""
        new = {s.name: s for s in specs}
        removed = [n for n in self._pods if n not in new]
        changed = [n for n, s in new.items() if n not in self._pods or self._pods[n].spec != s]
        if removed or changed:
            self.version += 1
        for n in removed:
            del self._pods[n]
            self._notify(n, None)
        for n in changed:
            spec = new[n]
            old = self._pods.get(n)
            state = PodState(spec=spec, models=set(spec.models))
            if old is not None:
                state.models |= old.models
                state.healthy = old.healthy
            self._pods[n] = state
            self._notify(n, spec)
        return changed, removed

    def get(self, name: str) -> PodState | None:
        return self._pods.get(name)

    def all(self) -> list[PodState]:
        return list(self._pods.values())

    def candidates(self, model: str) -> list[PodState]:
        """Healthy pods serving ``model`` (a base model or a LoRA adapter name)."""
        return [p for p in self._pods.values() if p.healthy and model in p.models]

    def candidates_for_role(self, model: str, *roles: Role) -> list[PodState]:
        """Healthy pods serving ``model`` in one of ``roles`` (P/D pools)."""
        return [p for p in self.candidates(model) if p.role_for(model) in roles]

    def served_models(self) -> set[str]:
        out: set[str] = set()
        for p in self._pods.values():
            if p.healthy:
                out |= p.models
        return out
