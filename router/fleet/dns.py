"""DNS discovery: the A/AAAA records of one or more (headless service) hostnames.

Each *source* (:class:`DnsDiscoverySettings`: a hostname, its pods' ports, models and
prefill/decode role) is re-resolved every ``interval_s`` (the shortest of the sources'
when there are several); one pod per address, named ``<ip>:<port>``.  Several sources
are how a P/D fleet behind plain DNS is described: a prefill service and a decode
service for one model, each source giving its addresses its role::

    discovery:
      kind: dns
      dns_sources:
        - {hostname: vllm-prefill, role: prefill, models: [llama]}
        - {hostname: vllm-decode, role: decode, models: [llama]}

(``discovery.dns``, a single source, still works, and is the first source when both are
set.)  A source whose lookup fails keeps its last addresses (the rest of the fleet is
updated as usual); one that never resolved contributes none.

One address under two sources is one pod (the same engine behind two services, e.g.
prefilling one model and decoding another): its models are the union (unknown, to be
learned from ``GET /v1/models``, if a source names none), each model takes the role the
first source naming it gives, and the ports and default role are the first source's.  A
model given two different roles is a *conflict*: the first source wins, the conflict is
counted once (:attr:`DnsDiscovery.conflicts`) and logged, rate-limited.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Sequence
from typing import Literal

from pydantic import ConfigDict, Field

from router.fleet.pods import PodRegistry, PodSpec
from router.fleet.roles import Role, RoleSpelling, role_overrides
from router.logs import RateLimitedLog

log = logging.getLogger("router.fleet.discovery")


class DnsDiscoverySettings(RoleSpelling):
    """One DNS source."""

    model_config = ConfigDict(extra="forbid")

    hostname: str = Field(min_length=1, description="headless service name")
    port: int = Field(default=8000, ge=1, le=65535, description="pods' HTTP port")
    scheme: Literal["http", "https"] = Field(default="http", description="pods' URL scheme")
    events_port: int | None = Field(
        default=None, ge=1, le=65535, description="pods' KV-event PUB port"
    )
    replay_port: int | None = Field(default=None, ge=1, le=65535, description="pods' replay port")
    models: list[str] = Field(default_factory=list, description="models every pod serves")
    interval_s: float = Field(default=10.0, gt=0, description="seconds between resolutions")
    role: Role = Field(default="both", description="P/D role of every address")
    roles: dict[str, Role] = Field(
        default_factory=dict, description="per-model P/D roles of every address"
    )


def host_in_url(ip: str) -> str:
    """An IP as it goes in a URL / ZMQ endpoint (IPv6 in brackets)."""
    try:
        if ipaddress.ip_address(ip).version == 6:
            return f"[{ip}]"
    except ValueError:
        pass
    return ip


def zmq_endpoint(ip: str, port: int | None) -> str | None:
    return None if port is None else f"tcp://{host_in_url(ip)}:{port}"


def _spec(s: DnsDiscoverySettings, ip: str) -> PodSpec:
    return PodSpec(
        name=f"{ip}:{s.port}",
        url=f"{s.scheme}://{host_in_url(ip)}:{s.port}",
        events_endpoint=zmq_endpoint(ip, s.events_port),
        replay_endpoint=zmq_endpoint(ip, s.replay_port),
        models=tuple(s.models),
        role=s.role,
        roles=role_overrides(s.roles),
    )


class DnsDiscovery:
    """Resolves every source's hostname every ``interval_s``: one pod per address."""

    def __init__(self, sources: DnsDiscoverySettings | Sequence[DnsDiscoverySettings]) -> None:
        self.sources = [sources] if isinstance(sources, DnsDiscoverySettings) else list(sources)
        if not self.sources:
            raise ValueError("DNS discovery needs at least one source (discovery.dns_sources)")
        #: the first source (what a single-source configuration set)
        self.settings = self.sources[0]
        self.interval_s = min(s.interval_s for s in self.sources)
        self.resolutions = 0
        self.failures = 0
        #: (pod, model) pairs two sources gave different roles (the first source wins)
        self.conflicting: set[tuple[str, str]] = set()
        self._last: dict[int, list[PodSpec]] = {}
        self._log = RateLimitedLog(log)  # one line per cause per 10 s, not per round

    @property
    def conflicts(self) -> int:
        """How many (pod, model) pairs two sources gave different roles."""
        return len(self.conflicting)

    async def resolve_source(self, s: DnsDiscoverySettings) -> list[PodSpec]:
        """One source's pods now (raises what ``getaddrinfo`` raises)."""
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(s.hostname, s.port, type=socket.SOCK_STREAM)
        return [_spec(s, ip) for ip in sorted({str(info[4][0]) for info in infos})]

    async def resolve(self) -> list[PodSpec]:
        """Every source resolved now and merged (raises on the first failure)."""
        return self.merge([await self.resolve_source(s) for s in self.sources])

    async def refresh(self) -> list[PodSpec]:
        """One round: each source resolved (a failing one keeps its last addresses,
        counted and logged), merged."""
        for i, s in enumerate(self.sources):
            try:
                self._last[i] = await self.resolve_source(s)
            except Exception as exc:  # gaierror, a bad name (UnicodeError): keep its last
                self.failures += 1
                self._log.warning(
                    ("resolve", s.hostname),
                    "DNS discovery: resolving %r failed: %s",
                    s.hostname,
                    exc,
                )
            else:
                self.resolutions += 1
        return self.merge([self._last[i] for i in sorted(self._last)])

    def merge(self, per_source: Sequence[Sequence[PodSpec]]) -> list[PodSpec]:
        """The sources' pods, one per address (the module docstring says how)."""
        merged: dict[str, PodSpec] = {}
        for specs in per_source:
            for spec in specs:
                first = merged.get(spec.name)
                merged[spec.name] = spec if first is None else self._join(first, spec)
        return list(merged.values())

    def _join(self, first: PodSpec, other: PodSpec) -> PodSpec:
        roles: dict[str, Role] = {}
        for spec in (first, other):
            named = {m: spec.role_for(m) for m in spec.models} | dict(spec.roles)
            for model, role in named.items():
                if model in roles and roles[model] != role:
                    self.conflicting.add((first.name, model))
                    self._log.warning(
                        ("conflict", first.name, model),
                        "DNS discovery: %s is %s for model %r in one source and %s in "
                        "another; keeping %s",
                        first.name,
                        roles[model],
                        model,
                        role,
                        roles[model],
                    )
                    continue
                roles.setdefault(model, role)
        models: tuple[str, ...] = ()
        if first.models and other.models:
            models = tuple(dict.fromkeys(first.models + other.models))
        overrides = {m: r for m, r in roles.items() if r != first.role}
        return PodSpec(
            name=first.name,
            url=first.url,
            events_endpoint=first.events_endpoint,
            replay_endpoint=first.replay_endpoint,
            models=models,
            role=first.role,
            roles=role_overrides(overrides),
        )

    async def run(self, registry: PodRegistry) -> None:
        while True:
            specs = await self.refresh()
            if self._last:  # nothing resolved yet: leave the registry as it is
                added, removed = registry.set_pods(specs)
                if added or removed:
                    log.info("DNS discovery: +%s -%s", added, removed)
            await asyncio.sleep(self.interval_s)
