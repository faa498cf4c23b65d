"""The smaller sections of `kvroute serve`'s settings (router/config.py): scraping the
pods' metrics, speculative index entries, the Responses API's owners, and the embedded
simulated fleet."""

from __future__ import annotations

from pydantic import Field, model_validator

from router.config_types import Section


class ScrapeSettings(Section):
    """Scraping each pod's /metrics for the load view."""

    interval_s: float = Field(default=1.0, gt=0, description="seconds between scrapes of one pod")
    timeout_s: float = Field(default=1.0, gt=0, description="timeout of one scrape")
    stale_after_s: float = Field(
        default=5.0, gt=0, description="scraped values older than this are treated as unknown"
    )


class SpeculativeSettings(Section):
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


class ResponsesSettings(Section):
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


class FleetSettings(Section):
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
