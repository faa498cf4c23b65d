"""The one configuration model of `kvroute serve`.

Sources, highest precedence first:

1. CLI flags (``--port 9000``, nested with a dot: ``--proxy.read-timeout-s 30``),
2. environment variables ``KVROUTE_*`` (nested with ``__``: ``KVROUTE_PROXY__READ_TIMEOUT_S``),
3. a YAML file given by ``--config FILE`` (or ``KVROUTE_CONFIG``),
4. the defaults below.

Unknown keys are an error everywhere (``extra="forbid"``), so a typo never silently
falls back to a default.  ``docs/config.md`` is the table of every setting.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from router.config_sections import (
    FleetSettings,
    ResponsesSettings,
    ScrapeSettings,
    SpeculativeSettings,
)
from router.config_sources import pop_config_flag, with_sources
from router.config_table import settings_rows, settings_table
from router.config_types import Names
from router.decision.disagg import PDSettings
from router.events.settings import EventsSettings
from router.fleet.discovery import DiscoverySettings
from router.fleet.health import HealthSettings
from router.proxy.settings import ProxySettings
from router.tenants.settings import SecuritySettings, Tenant, check_tenants

__all__ = [
    "FleetSettings",
    "ProxySettings",
    "ResponsesSettings",
    "ScrapeSettings",
    "Settings",
    "SpeculativeSettings",
    "config_rows",
    "config_table",
]


class Settings(BaseSettings):
    """Every setting of `kvroute serve` (see docs/config.md)."""

    model_config = SettingsConfigDict(
        env_prefix="KVROUTE_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_default=True,
    )

    host: str = Field(default="127.0.0.1", description="listen address (0.0.0.0 in a container)")
    port: int = Field(default=8000, ge=0, le=65535, description="listen port (0 = any free port)")
    workers: int = Field(
        default=1,
        ge=1,
        description="uvicorn worker processes; each keeps its own index and (without "
        "Redis) its own load view; /metrics merges all workers' metrics. On Kubernetes, "
        "scale with replicas",
    )
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    shutdown_grace_s: int = Field(
        default=30,
        ge=0,
        description="on SIGTERM, how long in-flight requests (streams included) may finish "
        "before they are cut; keep it below the pod's terminationGracePeriodSeconds",
    )

    policy: str = Field(default="cost", description="routing policy (scoring.policies)")
    policy_params: dict[str, Any] = Field(
        default_factory=dict, description="the policy's parameters (validated by the policy)"
    )

    models: Names = Field(
        default_factory=list,
        description="models that must be served for /ready (empty: every model pods serve)",
    )
    tokenizer: str = Field(
        default="builtin",
        description="default tokenizer spec: builtin | <model dir> | remote | approx",
    )
    tokenizers: dict[str, str] = Field(
        default_factory=dict, description="per-model tokenizer spec overriding `tokenizer`"
    )
    block_size: int | None = Field(
        default=None,
        ge=1,
        description="KV block size in tokens for every model (else learned from the pods' "
        "vllm:cache_config_info, else 16)",
    )
    block_sizes: dict[str, int] = Field(
        default_factory=dict, description="per-model block size overriding `block_size`"
    )
    max_model_len: dict[str, int] = Field(
        default_factory=dict,
        description="per-model max prompt+output length (also learned from /v1/models)",
    )

    redis_url: str | None = Field(
        default=None,
        description="share the index and the load view through this Redis (redis://...)",
    )
    redis_namespace: str = Field(
        default="kvroute", min_length=1, description="key prefix in Redis (one per router fleet)"
    )
    redis_request_deadline_s: float = Field(
        default=0.1,
        gt=0.0,
        description="deadline of each Redis call a request waits on (lookup, load, owner); "
        "past it the request is routed on what this replica has",
    )
    redis_background_deadline_s: float = Field(
        default=5.0,
        gt=0.0,
        description="deadline of Redis calls off the request path (event batches, sweeps, "
        "lease, heartbeats)",
    )
    redis_breaker_failures: int = Field(
        default=5,
        ge=1,
        description="consecutive Redis failures that open the circuit breaker (calls then "
        "fail at once; one probe after a jittered backoff)",
    )
    redis_breaker_backoff_cap_s: float = Field(
        default=5.0, gt=0.0, description="longest wait of the breaker before its probe"
    )
    redis_username: str | None = Field(
        default=None, description="Redis ACL user (AUTH username password); null: default user"
    )
    redis_password_file: str | None = Field(
        default=None,
        description="file holding the Redis password (AUTH; a mounted Secret); overrides a "
        "password in redis_url",
    )
    redis_ca_file: str | None = Field(
        default=None,
        description="CA bundle (PEM) to verify a TLS Redis (rediss://) against (default: the "
        "system trust store)",
    )
    index_writer: bool = Field(
        default=False,
        description="with redis_url: also apply KV events to Redis from this process "
        "(default off: one `kvroute index` writes, every replica reads)",
    )
    index_capacity: int = Field(
        default=10_000_000, ge=1, description="in-memory index: max (pod, block) entries (LRU)"
    )

    api_keys: Names = Field(
        default_factory=list,
        description="router-level API keys (Bearer); empty: Authorization passed through",
    )
    tenants: list[Tenant] = Field(
        default_factory=list,
        description="tenants (name, key_sha256, models, limits, share_cache): each request "
        "must carry a tenant's key; cache salts, stored responses and limits are per tenant "
        "(README: Security)",
    )
    tenant_salt_secret: str | None = Field(
        default=None,
        description="secret key of the per-tenant cache_salt HMAC (>= 32 characters; required "
        "with tenants)",
    )
    tenant_salt_secret_file: str | None = Field(
        default=None, description="file holding tenant_salt_secret (a mounted Secret)"
    )
    admin_keys: Names = Field(
        default_factory=list,
        description="keys (Bearer) for /v1/route, /metrics, /openapi.json when they are admin-only",
    )
    admin_key_sha256: Names = Field(
        default_factory=list, description="SHA-256 hex digests of admin keys (preferred)"
    )
    security: SecuritySettings = Field(default_factory=SecuritySettings)
    pod_header: str = Field(default="x-kvroute-pod", description="response header naming the pod")
    session_header: str = Field(
        default="x-session-id", description="request header with a session id (else body `user`)"
    )

    proxy: ProxySettings = Field(default_factory=ProxySettings)
    scrape: ScrapeSettings = Field(default_factory=ScrapeSettings)
    responses: ResponsesSettings = Field(default_factory=ResponsesSettings)
    fleet: FleetSettings = Field(default_factory=FleetSettings)
    pd: PDSettings = Field(default_factory=PDSettings)
    discovery: DiscoverySettings = Field(default_factory=DiscoverySettings)
    events: EventsSettings = Field(default_factory=EventsSettings)
    speculative: SpeculativeSettings = Field(default_factory=SpeculativeSettings)
    health: HealthSettings = Field(default_factory=HealthSettings)

    @field_validator("pod_header", "session_header")
    @classmethod
    def _header_name(cls, v: str) -> str:
        if not v or any(c.isspace() or c == ":" for c in v):
            raise ValueError(f"not a valid HTTP header name: {v!r}")
        return v.lower()

    @field_validator("block_sizes", "max_model_len")
    @classmethod
    def _positive_values(cls, v: dict[str, int]) -> dict[str, int]:
        bad = [k for k, n in v.items() if n <= 0]
        if bad:
            raise ValueError(f"must be positive for {', '.join(bad)}")
        return v

    @field_validator("redis_password_file", "redis_ca_file", "tenant_salt_secret_file")
    @classmethod
    def _file_exists(cls, v: str | None) -> str | None:
        if v is not None and not Path(v).is_file():
            raise ValueError(f"no such file: {v}")
        return v

    @field_validator("admin_key_sha256")
    @classmethod
    def _digests(cls, v: list[str]) -> list[str]:
        from router.tenants.settings import _digest

        return [_digest(d) for d in v]

    @model_validator(mode="after")
    def _tenancy(self) -> Settings:
        if self.tenants and self.api_keys:
            raise ValueError("api_keys and tenants: give each key holder a tenant instead")
        check_tenants(self.tenants, self.salt_secret())
        if self.redis_ca_file and not (self.redis_url or "rediss://").startswith("rediss://"):
            raise ValueError("redis_ca_file needs a TLS redis_url (rediss://...)")
        return self

    def salt_secret(self) -> str | None:
        """``tenant_salt_secret``, or the contents of ``tenant_salt_secret_file``."""
        if self.tenant_salt_secret_file is not None:
            return Path(self.tenant_salt_secret_file).read_text().strip() or None
        return self.tenant_salt_secret

    @model_validator(mode="after")
    def _one_index_writer(self) -> Settings:
        if self.index_writer and self.workers > 1:
            raise ValueError(
                f"index_writer with workers={self.workers}: every worker would apply every KV "
                "event to Redis (several writers on one namespace); run `kvroute index` as "
                "the writer, or one worker"
            )
        return self

    @model_validator(mode="after")
    def _policy_known(self) -> Settings:
        from scoring.policies.registry import available_policies

        if self.policy not in available_policies():
            raise ValueError(
                f"unknown policy {self.policy!r}; available: {', '.join(available_policies())}"
            )
        return self

    # -- loading -----------------------------------------------------------------------

    @classmethod
    def load(cls, argv: Sequence[str] | None = None, *, env_config: bool = True) -> Settings:
        """Settings from CLI ``argv`` > ``KVROUTE_*`` env > YAML (``--config``) > defaults."""
        args = list(argv or [])
        config_file, args = pop_config_flag(args)
        if config_file is None and env_config:
            config_file = os.environ.get("KVROUTE_CONFIG") or None
        if config_file is not None and not Path(config_file).is_file():
            raise FileNotFoundError(f"--config: no such file: {config_file}")
        loaded = with_sources(cls, args, config_file)()
        return cls.model_validate(loaded.model_dump())

    def block_size_for(self, model: str) -> int | None:
        """The configured block size of ``model`` (None: learn it from the pods)."""
        return self.block_sizes.get(model, self.block_size)

    def tokenizer_for(self, model: str) -> str:
        return self.tokenizers.get(model, self.tokenizer)


# -- the documentation table ---------------------------------------------------------------


def config_rows(
    model: type[BaseModel] = Settings, prefix: tuple[str, ...] = ()
) -> list[tuple[str, str, str, str, str]]:
    """(setting, env var, CLI flag, default, meaning) for every leaf setting."""
    return settings_rows(model, prefix)


def config_table() -> str:
    """The Markdown table of docs/config.md."""
    return settings_table(Settings)


if __name__ == "__main__":
    print(config_table(), end="")
