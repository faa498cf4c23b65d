"""The parameters of the ``cost`` policy (scoring/policies/cost.py; each one's role and
whether it is fitted, a prior or a switch: scoring/policies/README.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from scoring.index.base import DEFAULT_TIERS
from scoring.policies.base import PolicyParams


class CostParams(PolicyParams):
    prefill_rate_tokens_per_s: float = Field(
        default=5000.0,
        gt=0.0,
        description="prompt tokens one pod prefills per second (with learn_prefill_rate: "
        "the prior, until first tokens are observed)",
    )
    tier_load_rates_tokens_per_s: dict[str, float] = Field(
        default_factory=lambda: {"CPU": 50_000.0, "DISK": 10_000.0},
        description="tokens/s loaded from each slower tier into GPU memory",
    )
    tiers: tuple[str, ...] = DEFAULT_TIERS
    decode_slowdown_per_running: float | None = Field(
        default=None,
        ge=0.0,
        description="fractional prefill slowdown per running request (unset: learned from "
        "clean first tokens with learn_prefill_rate, else 0; kvroute calibrate prints an "
        "engine's)",
    )
    miss_weight: float = Field(
        default=1.0, ge=0.0, description="weight of uncached prompt tokens with no backlog"
    )
    backlog_weight: float | None = Field(
        default=None,
        ge=0.0,
        description="scale of the backlog term: followers per queued request (default 1), "
        "or with backlog_unit=prompt the miss weight per prompt of backlog (default 12)",
    )
    backlog_unit: Literal["prompt", "request"] = Field(
        default="request",
        description="the backlog a miss delays, in requests (the mean live request's "
        "predicted miss), or in prompts of this size times backlog_weight (the old default)",
    )
    fleet_backlog_share: float | None = Field(
        default=None,
        ge=0.0,
        le=1.0,
        description="share of the fleet's mean backlog every pod charges for a miss; "
        "default: 1 / the candidate pods (each pod's share of it)",
    )
    count_inflight_prefixes: bool = Field(
        default=True, description="treat prefixes of in-flight requests as cached"
    )
    discount_queued_hits: bool = Field(
        default=True, description="scale outstanding tokens by their predicted miss share"
    )
    lru_evictions: bool = Field(
        default=True,
        description="count only the cached blocks that survive the blocks routed to the "
        "pod since each was last routed there (LRU; needs hot_window_s > 0)",
    )
    queue_evictions: bool = Field(
        default=True,
        description="count only the cached prefix that survives the blocks of the requests "
        "queued ahead (LRU)",
    )
    tie_epsilon_s: float = Field(default=0.001, ge=0.0, description="predictions this close tie")
    tie_break_by_room: bool = Field(
        default=True, description="ties go to the pods with the most room for a new prefix"
    )
    hot_window_s: float = Field(
        default=300.0,
        ge=0.0,
        description="blocks routed to a pod this recently are hot (room, eviction charge); 0: off",
    )
    charge_hot_evictions: bool = Field(
        default=True, description="charge the hot blocks a miss would evict as misses"
    )
    kv_admission: bool = Field(
        default=True,
        description="add the wait for KV room on a pod whose free blocks cannot hold the "
        "request and the queue ahead (scoring/policies/kv_admission.py)",
    )
    kv_held_admitted: bool = Field(
        default=True,
        description="in the wait for KV room, count as held only the prefix blocks of live "
        "requests past their first token (admitted: their blocks are allocated); a "
        "request still waiting holds none",
    )
    charge_decode_steps: bool = Field(
        default=True,
        description="with the slowdown learned: charge (waiting + 1) x running x the seconds "
        "a running request adds to an engine step, learned from clean first tokens "
        "(scoring/policies/slowdown_fit.py)",
    )
    count_arrivals: bool = Field(
        default=False,
        description="count as followers of a miss the requests bound to the pod by its cache "
        "that arrive while the miss's prefill runs (opt-in; scoring/policies/README.md)",
    )
    queue_slowness: bool = Field(
        default=False,
        description="price each pod's queued tokens by how much slower (or faster) than "
        "the model's fit its first tokens came: FCFS service times over predicted ones, "
        "per pod, shrunk to 1 (opt-in; scoring/policies/README.md)",
    )
    learn_prefill_rate: bool = Field(
        default=True,
        description="learn each model's prefill rate from first tokens "
        "(prefill_rate_tokens_per_s is then the prior; scoring/policies/learned_rate.py)",
    )
    seed: int = 0

    @field_validator("tier_load_rates_tokens_per_s")
    @classmethod
    def _rates_positive(cls, v: dict[str, float]) -> dict[str, float]:
        for tier, rate in v.items():
            if not rate > 0:
                raise ValueError(f"load rate of tier {tier!r} must be > 0, got {rate}")
        return v
