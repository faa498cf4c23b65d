"""The tenancy settings: who the tenants are (``tenants``), the secret their cache salts
are derived from (``tenant_salt_secret``), the introspection keys (``admin_keys``) and
the ``security`` section.  Loaded as part of :class:`router.config.Settings`; the
meaning of each field is in its description (docs/config.md, README "Security")."""

from __future__ import annotations

import ipaddress
import logging
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

log = logging.getLogger(__name__)

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _digest(v: str) -> str:
    text = v.strip().lower()
    if not _HEX64.match(text):
        raise ValueError("a SHA-256 digest is 64 hex digits (`printf %s KEY | sha256sum`)")
    return text


class TenantLimits(_Section):
    """Per-tenant token buckets (refilled continuously; a bucket holds one minute's worth)."""

    requests_per_minute: float | None = Field(
        default=None, gt=0, description="requests admitted per minute (null: no limit)"
    )
    tokens_per_minute: float | None = Field(
        default=None,
        gt=0,
        description="prompt + completion tokens per minute (null: no limit); the prompt is "
        "charged on admission, the completion when the answer's usage arrives (streams "
        "too: the router asks for a stream's usage and hides it from a client that did not)",
    )


class Tenant(_Section):
    """One tenant: its key, the models it may use, its limits and cache sharing."""

    name: str = Field(description="the tenant's name (metrics label, owner records)")
    key_sha256: str | None = Field(
        default=None, description="SHA-256 hex digest of the tenant's API key (preferred)"
    )
    key: str | None = Field(
        default=None, description="the API key itself (allowed, warned: prefer key_sha256)"
    )
    models: list[str] = Field(
        default_factory=list, description="models the tenant may use (empty: all)"
    )
    limits: TenantLimits = Field(default_factory=TenantLimits)
    share_cache: bool = Field(
        default=False,
        description="share one prompt-cache salt with every other share_cache tenant "
        "(they can then see each other's cache hits); false: a salt of its own",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(f"tenant name {v!r}: 1-63 of [A-Za-z0-9_.-], starting alphanumeric")
        return v

    @field_validator("key_sha256")
    @classmethod
    def _key_sha256(cls, v: str | None) -> str | None:
        return None if v is None else _digest(v)

    @model_validator(mode="after")
    def _one_key(self) -> Tenant:
        if (self.key is None) == (self.key_sha256 is None):
            raise ValueError(f"tenant {self.name!r}: set exactly one of key_sha256 and key")
        if self.key is not None:
            if len(self.key) < 16:
                raise ValueError(f"tenant {self.name!r}: key shorter than 16 characters")
            log.warning(
                "tenant %r has a plaintext key in the configuration: prefer key_sha256",
                self.name,
            )
        return self


Access = Literal["admin", "open", "off"]


class SecuritySettings(_Section):
    """Who may see what: the introspection endpoints, a trusted tenant header."""

    route_endpoint: Access = Field(
        default="admin",
        description="POST /v1/route with tenants or admin keys configured: admin (an admin "
        "key required, else 403), open (any caller), off (404)",
    )
    metrics_endpoint: Access = Field(
        default="admin",
        description="GET /metrics with tenants or admin keys configured: admin, open, off",
    )
    openapi_endpoint: Access = Field(
        default="admin",
        description="GET /openapi.json with tenants or admin keys configured: admin, open, off",
    )
    tenant_header: str | None = Field(
        default=None,
        description="a request header naming the tenant, set by an authenticating gateway in "
        "front (e.g. x-kvroute-tenant); honoured only from tenant_header_networks; null: off",
    )
    tenant_header_networks: list[str] = Field(
        default_factory=list,
        description="CIDRs of the gateways trusted to set tenant_header (the TCP peer "
        "address; e.g. 10.0.0.0/8)",
    )

    @field_validator("tenant_header")
    @classmethod
    def _header(cls, v: str | None) -> str | None:
        if v is not None and (not v or any(c.isspace() or c == ":" for c in v)):
            raise ValueError(f"not a valid HTTP header name: {v!r}")
        return v.lower() if v else v

    @field_validator("tenant_header_networks")
    @classmethod
    def _networks(cls, v: list[str]) -> list[str]:
        for net in v:
            try:
                ipaddress.ip_network(net, strict=False)
            except ValueError as exc:
                raise ValueError(f"tenant_header_networks: {exc}") from None
        return v

    @model_validator(mode="after")
    def _header_needs_networks(self) -> SecuritySettings:
        if self.tenant_header and not self.tenant_header_networks:
            raise ValueError(
                "security.tenant_header needs security.tenant_header_networks (the gateways "
                "trusted to set it)"
            )
        return self


def check_tenants(tenants: list[Tenant], secret: str | None) -> None:
    """Tenant names unique; keys unique; a salt secret of >= 32 characters when
    tenants are set (raises ValueError)."""
    if not tenants:
        return
    names = [t.name for t in tenants]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"tenants: duplicate names {', '.join(dup)}")
    if secret is None:
        raise ValueError(
            "tenants need tenant_salt_secret (or tenant_salt_secret_file): the key of the "
            "per-tenant cache salts"
        )
    if len(secret) < 32:
        raise ValueError("tenant_salt_secret: at least 32 characters")
