"""``precise_prefix``: llm-d's precise prefix-cache scheduling, as a weighted sum of three
scorers over the KV-event index (llm-d ``precise-prefix-cache-scorer`` +
``kv-cache-utilization-scorer`` + ``queue-scorer`` + ``max-score-picker``).

Per candidate pod, with ``hits[t]`` = leading blocks servable from tier ``t`` or faster::

    raw(pod)    = sum over tiers t (fastest first) of
                  tier_weights[t] * (hits[t] - hits[faster tier])   # GPU 1.0, CPU 0.8
    prefix(pod) = (raw - min raw) / (max raw - min raw)   over pods with raw > 0;
                  1.0 when they are all equal; 0.0 for pods holding nothing
    queue(pod)  = (max q - q) / (max q - min q), 1.0 when all equal,
                  q = scraped ``waiting`` (router ``inflight`` when not scraped)
    kv(pod)     = 1 - kv_usage   (0.5 when not scraped)
    score       = prefix_weight * prefix + kv_usage_weight * kv + queue_weight * queue

The highest score wins; equal scores are broken by a seeded random draw (llm-d's
max-score-picker shuffles).  Default weights 3 / 2 / 2 are those of llm-d's
precise-prefix-cache-aware guide.  Tiers absent from ``tier_weights`` weigh 0.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from pydantic import Field, field_validator

from scoring.index.base import DEFAULT_TIERS
from scoring.policies.base import Decision, PodView, Policy, PolicyParams, RouteRequest
from scoring.policies.select import highest, require_candidates


class PrecisePrefixParams(PolicyParams):
    prefix_weight: float = Field(default=3.0, ge=0.0)
    kv_usage_weight: float = Field(default=2.0, ge=0.0)
    queue_weight: float = Field(default=2.0, ge=0.0)
    tier_weights: dict[str, float] = Field(default_factory=lambda: {"GPU": 1.0, "CPU": 0.8})
    tiers: tuple[str, ...] = DEFAULT_TIERS
    seed: int = 0

    @field_validator("tier_weights")
    @classmethod
    def _weights_in_range(cls, v: dict[str, float]) -> dict[str, float]:
        for tier, w in v.items():
            if not 0.0 <= w <= 1.0:
                raise ValueError(f"tier weight for {tier!r} must be in [0, 1], got {w}")
        return v


def weighted_prefix(hits: dict[str, int], tiers: Sequence[str], weights: dict[str, float]) -> float:
    """Longest cached prefix in blocks, each block weighted by the fastest tier holding it."""
    raw = 0.0
    prev = 0
    for tier in tiers:
        n = hits.get(tier)
        if n is None:
            continue
        if n > prev:
            raw += weights.get(tier, 0.0) * (n - prev)
            prev = n
    return raw


def min_max(values: dict[str, float], *, low_is_good: bool = False) -> dict[str, float]:
    """Min-max normalise to [0, 1] (1 = best); all equal -> 1.0 each."""
    lo, hi = min(values.values()), max(values.values())
    if hi == lo:
        return dict.fromkeys(values, 1.0)
    if low_is_good:
        return {k: (hi - v) / (hi - lo) for k, v in values.items()}
    return {k: (v - lo) / (hi - lo) for k, v in values.items()}


class PrecisePrefixPolicy(Policy):
    name = "precise_prefix"
    Params = PrecisePrefixParams

    def __init__(self, params: PolicyParams | None = None) -> None:
        super().__init__(params)
        assert isinstance(self.params, PrecisePrefixParams)
        self._p: PrecisePrefixParams = self.params
        self._rng = random.Random(self._p.seed)

    def pick(self, request: RouteRequest, pods: Sequence[PodView]) -> Decision:
        require_candidates(self.name, pods)
        p = self._p
        raw = {pod.pod: weighted_prefix(pod.hits, p.tiers, p.tier_weights) for pod in pods}
        holding = {k: v for k, v in raw.items() if v > 0}
        prefix = dict.fromkeys(raw, 0.0)
        if holding:
            prefix.update(min_max(holding))
        queue = min_max(
            {
                pod.pod: float(pod.waiting if pod.waiting is not None else pod.inflight)
                for pod in pods
            },
            low_is_good=True,
        )
        kv = {pod.pod: 1.0 - (pod.kv_usage if pod.kv_usage is not None else 0.5) for pod in pods}
        scores = {
            name: p.prefix_weight * prefix[name]
            + p.kv_usage_weight * kv[name]
            + p.queue_weight * queue[name]
            for name in raw
        }
        chosen, _ = highest(list(scores), list(scores.values()), self._rng)
        return Decision(
            pod=chosen,
            scores=scores,
            detail={"prefix": prefix, "queue": queue, "kv": kv},
        )
