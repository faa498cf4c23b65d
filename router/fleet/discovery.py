"""Pod discovery: where the fleet comes from (static list, DNS, Kubernetes).

Every source produces a full set of :class:`PodSpec` and hands it to
:meth:`PodRegistry.set_pods`, which diffs it and tells the listeners (KV-event
subscriber, scraper) which pods came and went.

* ``static`` — the configured list, once.
* ``dns`` — the A/AAAA records of one or more (headless service) hostnames
  (``dns``, and ``dns_sources`` for more: e.g. a prefill and a decode service),
  re-resolved every ``interval_s``; pod name ``<ip>:<port>``.  A failed lookup keeps
  that source's last addresses (:mod:`router.fleet.dns`).
* ``k8s`` — list + watch Pods matching a label selector in one namespace through the
  API server's REST API (service-account token and CA), keeping only *Ready* pods with
  a ``podIP``; re-list on ``410 Gone``.  Pod name = ``metadata.name``; ports come from
  the annotations ``kvroute.io/port``, ``kvroute.io/events-port``,
  ``kvroute.io/replay-port`` (and models from ``kvroute.io/models``, comma separated),
  else from these settings.  With several ``ports`` (an InferencePool's
  ``targetPorts``), each pod is one endpoint per port, ``<pod>-rank-<i>``, as GIE's
  picker counts them; rank i's KV events on ``events_port + i`` (vLLM's
  data-parallel convention), on the ports GIE's ``inference.networking.k8s.io/active-ports``
  annotation lists (all without it).  Pod object -> endpoints: :mod:`router.fleet.k8s_endpoints`.

Every source also gives each pod its prefill/decode role (:mod:`router.fleet.roles`):
``role`` / ``roles`` on a static pod or the DNS source; on Kubernetes the first of
``role_keys`` (labels ``kvroute.io/role``, llm-d's ``llm-d.ai/role``; then the same
annotations) and the ``kvroute.io/roles`` annotation.  A bad role value skips the pod
(Kubernetes) or fails the settings (static, DNS), naming the value.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from router.fleet.dns import DnsDiscovery, DnsDiscoverySettings
from router.fleet.k8s import K8sDiscovery, K8sDiscoverySettings
from router.fleet.pods import PodRegistry, PodSpec
from router.fleet.roles import Role, RoleSpelling, role_overrides


class StaticPod(RoleSpelling):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, description="unique pod name (metrics label, header)")
    url: str = Field(min_length=1, description="HTTP base URL, e.g. http://10.0.0.7:8000")
    events_endpoint: str | None = Field(
        default=None, description="ZMQ PUB to dial, tcp://host:5557"
    )
    replay_endpoint: str | None = Field(default=None, description="ZMQ ROUTER for replays")
    models: list[str] = Field(
        default_factory=list, description="models served (else learned from /v1/models)"
    )
    role: Role = Field(default="both", description="P/D role: prefill, decode or both")
    roles: dict[str, Role] = Field(
        default_factory=dict, description="per-model P/D roles, {model: role}"
    )

    @field_validator("url")
    @classmethod
    def _http_url(cls, v: str) -> str:
        scheme, sep, rest = v.partition("://")
        host = rest.split("/", 1)[0]
        if not sep or scheme.lower() not in ("http", "https") or not host or host.startswith(":"):
            raise ValueError(
                f"pod url {v!r} needs a scheme and a host: http://HOST:PORT (or https://)"
            )
        return v

    def spec(self) -> PodSpec:
        return PodSpec(
            name=self.name,
            url=self.url.rstrip("/"),
            events_endpoint=self.events_endpoint,
            replay_endpoint=self.replay_endpoint,
            models=tuple(self.models),
            role=self.role,
            roles=role_overrides(self.roles),
        )


#: JSON schema: the section a kind reads is present and not null
_SECTION_REQUIRED: list[Any] = [
    {
        "if": {"properties": {"kind": {"const": kind}}, "required": ["kind"]},
        "then": {"required": [kind], "properties": {kind: {"type": "object"}}},
    }
    for kind in ("k8s",)
] + [
    {
        "if": {"properties": {"kind": {"const": "dns"}}, "required": ["kind"]},
        "then": {
            "anyOf": [
                {"required": ["dns"], "properties": {"dns": {"type": "object"}}},
                {"required": ["dns_sources"], "properties": {"dns_sources": {"minItems": 1}}},
            ]
        },
    }
]


class DiscoverySettings(BaseModel):
    """Where pods come from (nested as ``discovery`` in the router's config).

    ``kind: dns`` needs the ``dns`` section or ``dns_sources`` and ``kind: k8s`` the
    ``k8s`` one (its
    ``label_selector`` required): checked by the model, and by the JSON schema generated
    from it (the Helm chart's ``values.schema.json``), so ``helm install`` refuses such
    values instead of starting a router that exits."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"allOf": _SECTION_REQUIRED})

    kind: Literal["static", "dns", "k8s"] = Field(
        default="static", description="where pods come from"
    )
    static: list[StaticPod] = Field(default_factory=list, description="kind static: the pods")
    dns: DnsDiscoverySettings | None = Field(default=None, description="kind dns: its settings")
    dns_sources: list[DnsDiscoverySettings] = Field(
        default_factory=list,
        description="kind dns: more sources after `dns` (e.g. a prefill and a decode "
        "service, each with its role)",
    )
    k8s: K8sDiscoverySettings | None = Field(default=None, description="kind k8s: its settings")

    @model_validator(mode="after")
    def _section_present(self) -> DiscoverySettings:
        if self.kind == "dns" and self.dns is None and not self.dns_sources:
            raise ValueError(
                "discovery.kind is 'dns' but discovery.dns is not set (nor discovery.dns_sources)"
            )
        where = [(s.hostname, s.port) for s in self.all_dns_sources()]
        twice = sorted({f"{h}:{p}" for h, p in where if where.count((h, p)) > 1})
        if twice:
            raise ValueError(f"discovery: DNS sources listed twice: {twice}")
        if self.kind == "k8s" and self.k8s is None:
            raise ValueError("discovery.kind is 'k8s' but discovery.k8s is not set")
        names = [p.name for p in self.static]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"discovery.static: duplicate pod names {dup}")
        return self

    def all_dns_sources(self) -> list[DnsDiscoverySettings]:
        """``dns`` (when set) then ``dns_sources``."""
        return ([self.dns] if self.dns is not None else []) + list(self.dns_sources)


class Discovery(Protocol):
    async def run(self, registry: PodRegistry) -> None:
        """Keep ``registry`` up to date until cancelled."""
        ...


class StaticDiscovery:
    def __init__(self, pods: list[StaticPod]) -> None:
        self.pods = pods

    async def run(self, registry: PodRegistry) -> None:
        registry.set_pods(p.spec() for p in self.pods)


def build_discovery(settings: DiscoverySettings) -> Discovery:
    """The discovery source ``settings.kind`` names."""
    if settings.kind == "dns":
        return DnsDiscovery(settings.all_dns_sources())
    if settings.kind == "k8s":
        assert settings.k8s is not None
        return K8sDiscovery(settings.k8s)
    return StaticDiscovery(settings.static)
