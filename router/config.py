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

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    SettingsConfigDict,
)

from router.config_sources import pop_config_flag, with_sources
from router.config_table import settings_rows, settings_table
from router.decision.disagg import PDSettings
from router.events.settings import EventsSettings
from router.fleet.discovery import DiscoverySettings
from router.fleet.health import HealthSettings
from router.tenants.settings import SecuritySettings, Tenant, check_tenants


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _names(value: Any) -> Any:
    """A list of names from an env var: JSON (``["a", "b"]``) or comma-separated."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            return json.loads(text)
        return [part.strip() for part in text.split(",") if part.strip()]
    return value


#: a list of strings that ``KVROUTE_*`` env vars may also spell ``a,b,c``
Names = Annotated[list[str], NoDecode, BeforeValidator(_names)]


#: the paths `kvroute serve` answers itself (not passthrough paths)
OWN_PATHS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/responses",
        "/v1/route",
        "/v1/models",
        "/health",
        "/ready",
        "/metrics",
    }
)
#: vLLM's other JSON POST endpoints, relayed by default (``/v1/responses`` is served by
#: the router itself: a response naming a ``previous_response_id`` must reach the pod
#: that stored it, see router/decision/owners.py)
PASSTHROUGH_PATHS = (
    "/tokenize",
    "/detokenize",
    "/pooling",
    "/classify",
    "/score",
    "/v1/score",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
)


def _on_off_schema(schema: dict[str, Any]) -> None:
    """``off`` / ``on`` or a boolean: YAML 1.1 (Helm's too) reads a bare off / on as one."""
    schema["anyOf"] = [
        {"enum": schema.pop("enum"), "type": schema.pop("type")},
        {"type": "boolean"},
    ]


class ProxySettings(_Section):
    """How requests are forwarded to pods."""

    connect_timeout_s: float = Field(default=2.0, gt=0, description="TCP connect timeout to a pod")
    read_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="max wait for the next byte from a pod: between the chunks of a stream, "
        "and for the head of a non-streaming answer (which comes when the whole generation "
        "is done)",
    )
    first_byte_timeout_s: float | None = Field(
        default=60.0,
        gt=0,
        description="a streaming request (or a JSON answer assembled from a stream: "
        "proxy.stream_json_answers) whose pod sends no first body byte (the first SSE "
        "event: after queueing and prefill; of a Responses stream, the first after "
        "response.created and response.in_progress, held until then) within this is "
        "cancelled there and failed over "
        "to the next pod once; null: no deadline. JSON answers sent as they came have none "
        "(their head is the whole answer); they fail over when their pod is ejected",
    )
    stream_json_answers: bool = Field(
        default=True,
        description="a chat or text completion that asks for a JSON answer (one choice, no "
        "logprobs or echo, more than one token), or a Responses request that does not run "
        "in the background, is asked of its pod as a stream and assembled into the JSON "
        "answer at the router, so its first token is seen as a stream's: TTFT, the "
        "prefill part of its load, the policy's learned rates and the first-byte deadline "
        "(router/proxy/assemble.py, responses_answer.py); `kvroute epp` too, the pod's "
        "response headers held until the answer is whole (router/epp/assembled.py); "
        "false: sent as it came",
    )
    ejected_stream_idle_s: float = Field(
        default=10.0,
        gt=0,
        description="a stream already relaying from a pod that health checks eject or "
        "discovery removes ends (truncated: stream_broken) once that pod sends nothing for "
        "this long; streams still flowing (a pod draining) go on",
    )
    max_keepalive: int = Field(
        default=200, ge=0, description="idle keep-alive connections kept per pod"
    )
    max_body_bytes: int = Field(
        default=16 * 1024 * 1024, ge=1024, description="largest request body accepted (413 above)"
    )
    max_header_bytes: int = Field(
        default=64 * 1024,
        ge=1024,
        description="largest request head accepted from a client (request line and headers; "
        "431 above, before routing)",
    )
    max_headers: int = Field(
        default=100, ge=1, description="most request header lines accepted (431 above)"
    )
    client_keepalive_timeout_s: float = Field(
        default=5.0,
        gt=0,
        description="a client connection with no request in progress (new, or idle between "
        "keep-alive requests) is closed after this (uvicorn's default); behind a load "
        "balancer keep it above the balancer's idle timeout",
    )
    client_header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="a request head not complete this long after its first bytes: 408, "
        "connection closed",
    )
    client_body_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="a request body not complete this long after its head (a client that "
        "stops or trickles): 408, connection closed; max_body_bytes at >= 4.5 Mbit/s",
    )
    max_json_depth: int = Field(
        default=128,
        ge=2,
        le=500,
        description="deepest JSON nesting accepted in a request body (400 invalid_json "
        "above; the top-level object is 1); serde_json's default",
    )
    retries: int = Field(
        default=1,
        ge=0,
        le=3,
        description="retries on the next-best pod when connecting fails or the pod answers "
        "502/503 before any byte reached the client; a failover (first-byte deadline, pod "
        "ejected or removed) takes one of them, and happens at most once per request",
    )
    passthrough_paths: Names = Field(
        default_factory=lambda: list(PASSTHROUGH_PATHS),
        description="other POST endpoints of the pods relayed as they are (JSON bodies with a "
        "`model`, or none when one model is served), to the least-loaded pod serving it",
    )
    pod_ca_file: str | None = Field(
        default=None,
        description="CA bundle (PEM) to verify https pods against (default: the system "
        "trust store); used by requests, health checks and scrapes",
    )
    pod_tls_verify: bool = Field(
        default=True,
        description="verify https pods' certificates and host names; false is INSECURE "
        "(encrypted but unauthenticated: anyone on the path can pose as a pod)",
    )

    access_log: Literal["off", "on"] = Field(
        default="off",
        json_schema_extra=_on_off_schema,
        description="one line per generation request on stdout when its response ends "
        "(method, path, status, model, pod, prompt and predicted cached tokens, TTFT, "
        "latency; never the prompt): off or on (docs/observability.md)",
    )
    access_log_sample: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description="with access_log on, the share of requests logged (drawn per request)",
    )
    access_log_format: Literal["text", "json"] = Field(
        default="text", description="access-log lines as key=value text or one JSON object"
    )

    @field_validator("access_log", mode="before")
    @classmethod
    def _on_off(cls, v: Any) -> Any:
        # YAML 1.1 reads a bare off / on as a boolean
        if isinstance(v, bool):
            return "on" if v else "off"
        return v

    @field_validator("passthrough_paths")
    @classmethod
    def _passthrough_paths(cls, v: list[str]) -> list[str]:
        for path in v:
            if not path.startswith("/") or "?" in path or "#" in path:
                raise ValueError(f"passthrough path {path!r}: a path starting with '/'")
            if path in OWN_PATHS:
                raise ValueError(f"passthrough path {path!r}: kvroute serves it itself")
        return v

    @field_validator("pod_ca_file")
    @classmethod
    def _ca_file_exists(cls, v: str | None) -> str | None:
        if v is not None and not Path(v).is_file():
            raise ValueError(f"no such CA file: {v}")
        return v


class ScrapeSettings(_Section):
    """Scraping each pod's /metrics for the load view."""

    interval_s: float = Field(default=1.0, gt=0, description="seconds between scrapes of one pod")
    timeout_s: float = Field(default=1.0, gt=0, description="timeout of one scrape")
    stale_after_s: float = Field(
        default=5.0, gt=0, description="scraped values older than this are treated as unknown"
    )


class SpeculativeSettings(_Section):
    """Speculative index entries: pods learned from the requests routed to them where KV
    events cannot tell (router/decision/learning.py)."""

    enabled: bool = Field(
        default=True,
        description="learn pods that publish no KV events, or whose index entries were lost, "
        "from the requests routed to them",
    )
    ttl_s: float = Field(
        default=120.0,
        gt=0,
        description="seconds a routed chain is held for a learning pod, re-armed by every "
        "request with it (Dynamo's --router-ttl-secs default)",
    )
    routed_ttl_s: float = Field(
        default=0.0,
        ge=0,
        description="if > 0: every routed chain is held this long on any pod, covering the "
        "gap until its BlockStored (llm-d's speculativeTTL: 2 s); 0 = off",
    )
    max_entries: int = Field(
        default=250_000,
        ge=1,
        description="max speculative (pod, block) entries; past it the nearest to expiry go",
    )
    verify: bool = Field(
        default=True,
        description="drop speculative blocks the pod's vllm:prefix_cache_hits_total does not "
        "show it hit",
    )


class ResponsesSettings(_Section):
    """The Responses API (/v1/responses): which pod owns a stored response."""

    owner_ttl_s: float = Field(
        default=86_400.0,
        gt=0,
        description="how long the router remembers which pod created a response (follow-ups "
        "with previous_response_id, GET and cancel go there); with redis_url the key "
        "{namespace}:resp:{id} expires after this",
    )
    max_owners: int = Field(
        default=100_000,
        ge=1,
        description="without redis_url: response owners kept in memory (LRU); each replica "
        "knows only the responses it relayed",
    )


class FleetSettings(_Section):
    """The embedded simulated fleet started when no pods are configured."""

    enabled: bool = Field(default=True, description="start it when no pods are configured")
    pods: int = Field(default=4, ge=0, le=64, description="number of simulated pods of role both")
    prefill_pods: int = Field(
        default=0, ge=0, le=64, description="simulated pods of role prefill (P/D, docs/pd.md)"
    )
    decode_pods: int = Field(
        default=0, ge=0, le=64, description="simulated pods of role decode (P/D, docs/pd.md)"
    )
    model: str = Field(default="sim-model", description="model name the simulated pods serve")
    block_size: int = Field(default=16, ge=1, description="simulated KV block size (tokens)")
    capacity_tokens: int = Field(
        default=65536, ge=1, description="prefix-cache capacity of each simulated pod (tokens)"
    )
    prefill_tokens_per_s: float = Field(default=20000.0, gt=0, description="simulated prefill rate")
    decode_tokens_per_s: float = Field(default=200.0, gt=0, description="simulated decode rate")

    @model_validator(mode="after")
    def _some_pod(self) -> FleetSettings:
        if self.pods + self.prefill_pods + self.decode_pods < 1:
            raise ValueError("fleet: pods + prefill_pods + decode_pods must be at least 1")
        return self

    def roles(self) -> list[tuple[str, str]]:
        """(pod name, role) of every pod: ``sim-<i>`` (both), ``sim-p<i>``, ``sim-d<i>``."""
        return (
            [(f"sim-{i}", "both") for i in range(self.pods)]
            + [(f"sim-p{i}", "prefill") for i in range(self.prefill_pods)]
            + [(f"sim-d{i}", "decode") for i in range(self.decode_pods)]
        )


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
