"""``cost`` (the default): send the request where its predicted time to first token is
lowest.

For each candidate pod, with ``P`` prompt tokens, block size ``B`` and ``hits[t]`` =
leading blocks servable from tier ``t`` or faster (tiers fastest first)::

    cached[t]   = min(hits[t] * B, P)                      # made monotone over tiers
    transfer    = sum over slower tiers t with a rate of
                  (cached[t] - cached[faster]) / tier_load_rates_tokens_per_s[t]
    uncached    = P - cached[slowest tier with a rate]
    slowdown    = 1 + decode_slowdown_per_running * running
                  (running = scraped ``running``; router ``inflight`` when not scraped)
    queue_wait  = outstanding_prefill_tokens / prefill_rate_tokens_per_s * slowdown
    ttft(pod)   = queue_wait + uncached / prefill_rate_tokens_per_s * slowdown + transfer

The pod with the smallest ``ttft`` wins.  Pods within ``tie_epsilon_s`` of the minimum
are tied; among them the winner is chosen by rendezvous hashing of the request id
(highest ``xxh3(seed, request_id + pod)``): deterministic for a request, uniform across
pods, with no bias toward the first candidate.  ``Decision.scores`` holds each pod's
predicted TTFT in seconds (``lower_is_better``).

``outstanding_prefill_tokens`` counts whole prompts (the router does not know how much
of a queued prompt will hit), so ``queue_wait`` is an upper bound: requests queued
behind cached work look slower than they are, which errs toward spreading load.
"""

from __future__ import annotations

from collections.abc import Sequence

import xxhash
from pydantic import Field, field_validator

from scoring.index.base import DEFAULT_TIERS
from scoring.policies.base import (
    Decision,
    NoCandidatesError,
    PodView,
    Policy,
    PolicyParams,
    RouteRequest,
)

_h64 = xxhash.xxh3_64_intdigest


class CostParams(PolicyParams):
    prefill_rate_tokens_per_s: float = Field(
        default=5000.0, gt=0.0, description="prompt tokens one pod prefills per second"
    )
    tier_load_rates_tokens_per_s: dict[str, float] = Field(
        default_factory=lambda: {"CPU": 50_000.0, "DISK": 10_000.0},
        description="tokens/s loaded from each slower tier into GPU memory",
    )
    tiers: tuple[str, ...] = DEFAULT_TIERS
    decode_slowdown_per_running: float = Field(
        default=0.0, ge=0.0, description="fractional prefill slowdown per running request"
    )
    tie_epsilon_s: float = Field(default=0.001, ge=0.0, description="predictions this close tie")
    seed: int = 0

    @field_validator("tier_load_rates_tokens_per_s")
    @classmethod
    def _rates_positive(cls, v: dict[str, float]) -> dict[str, float]:
        for tier, rate in v.items():
            if not rate > 0:
                raise ValueError(f"load rate of tier {tier!r} must be > 0, got {rate}")
        return v


def predict_ttft(request: RouteRequest, pod: PodView, p: CostParams) -> tuple[float, int]:
    """Predicted TTFT (s) of ``request`` on ``pod`` and the prompt tokens it would reuse."""
    prompt = request.prompt_tokens
    bs = request.block_size
    cached = 0
    transfer = 0.0
    first = True
    for tier in p.tiers:
        n = pod.hits.get(tier)
        if n is None:
            first = False
            continue
        tok = min(n * bs, prompt)
        if tok > cached:
            if first:
                cached = tok
            else:
                rate = p.tier_load_rates_tokens_per_s.get(tier)
                if rate is None:
                    first = False
                    continue
                transfer += (tok - cached) / rate
                cached = tok
        first = False
    running = pod.running if pod.running is not None else pod.inflight
    slowdown = 1.0 + p.decode_slowdown_per_running * running
    work = pod.outstanding_prefill_tokens + (prompt - cached)
    return work / p.prefill_rate_tokens_per_s * slowdown + transfer, cached


class CostPolicy(Policy):
    name = "cost"
    Params = CostParams

    def __init__(self, params: PolicyParams | None = None) -> None:
        super().__init__(params)
        assert isinstance(self.params, CostParams)
        self._p: CostParams = self.params

    def pick(self, request: RouteRequest, pods: Sequence[PodView]) -> Decision:
        if not pods:
            raise NoCandidatesError("cost: no candidate pods")
        predicted: dict[str, float] = {}
        cached: dict[str, int] = {}
        for pod in pods:
            predicted[pod.pod], cached[pod.pod] = predict_ttft(request, pod, self._p)
        best = min(predicted.values())
        tied = [name for name, t in predicted.items() if t <= best + self._p.tie_epsilon_s]
        if len(tied) == 1:
            chosen = tied[0]
        else:
            rid = request.request_id
            seed = self._p.seed
            chosen = max(tied, key=lambda name: _h64(f"{rid}\x00{name}".encode(), seed))
        return Decision(
            pod=chosen,
            scores=predicted,
            lower_is_better=True,
            detail={"cached_tokens": cached, "tied": len(tied)},
        )
