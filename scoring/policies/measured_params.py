"""The parameters of the ``measured`` policy (scoring/policies/measured.py): the priors it
uses until a pod's observations identify its rates, how long it remembers, and its
switches (each one's role: scoring/policies/README.md)."""

from __future__ import annotations

import math

from pydantic import Field, field_validator

from scoring.index.base import DEFAULT_TIERS
from scoring.policies.base import PolicyParams


class MeasuredParams(PolicyParams):
    prefill_rate_tokens_per_s: float = Field(
        default=5000.0, gt=0.0, description="prior: prompt tokens an idle pod prefills per s"
    )
    prefill_slowdown_per_running: float = Field(
        default=0.0, ge=0.0, description="prior: fractional prefill slowdown per running request"
    )
    request_overhead_s: float = Field(
        default=0.0, ge=0.0, description="prior: fixed prefill seconds per request"
    )
    decode_step_s: float = Field(default=0.025, gt=0.0, description="prior: s per decode step")
    decode_step_per_running_s: float = Field(
        default=0.0, ge=0.0, description="prior: decode step seconds per decoding request"
    )
    output_tokens: float = Field(default=256.0, gt=0.0, description="prior: mean output tokens")
    memory: float = Field(
        default=64.0, ge=2.0, description="observations the estimates remember (forgetting)"
    )
    prior_weight: float = Field(default=4.0, gt=0.0, description="observations a prior weighs as")
    tier_load_rates_tokens_per_s: dict[str, float] = Field(
        default_factory=lambda: {"CPU": 50_000.0, "DISK": 10_000.0},
        description="tokens/s loaded from each slower tier into GPU memory",
    )
    tiers: tuple[str, ...] = DEFAULT_TIERS
    count_inflight_prefixes: bool = True
    hot_window_s: float = Field(
        default=300.0,
        ge=0.0,
        description="blocks routed to a pod this recently are hot: a miss that evicts them "
        "is charged their recompute (0: off)",
    )
    tie_epsilon_s: float = Field(default=0.001, ge=0.0)
    pooled_delay: bool = Field(
        default=True,
        description="count the requests a fleet-wide backlog queues behind the work too",
    )
    seed: int = 0

    @field_validator("tier_load_rates_tokens_per_s")
    @classmethod
    def _rates_positive(cls, v: dict[str, float]) -> dict[str, float]:
        for tier, rate in v.items():
            if not (rate > 0 and math.isfinite(rate)):
                raise ValueError(f"load rate of tier {tier!r} must be > 0, got {rate}")
        return v
