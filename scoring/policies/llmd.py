"""``llmd``: llm-d's "precise" scheduling profile, from its published source
(``llm-d/llm-d-router`` deploy/config/epp-precise-prefix-cache-config.yaml,
pkg/epp/framework/plugins/scheduling/{scorer,filter,picker}/**, pkg/kvcache/).

Per request, over the candidate pods::

    match(pod)  = floor(sum over the longest run of leading blocks the pod holds of the
                  weight of the fastest tier holding each block)  # gpu 1.0, cpu 0.8,
                                                                 # other tiers 1.0
    prefix(pod) = match / len(block_keys)           # prefix-cache-scorer (0 with no keys)

    prefix-cache-affinity-filter (affinity_filter):
        with probability exploration_probability keep every pod; else
        sticky = pods with prefix >= affinity_threshold; none -> keep every pod;
        if min TTFT(sticky) - min TTFT(others) > max_ttft_penalty_ms -> keep every pod;
        else keep the sticky pods
        TTFT(pod) = active / peak_prefill_throughput_tokens_per_s * 1000   (ms)
        active    = uncached prompt tokens of the requests routed to the pod still in
                    prefill (scoring.policies.prefill_load; llm-d's InFlightLoad.Tokens)

    over the kept pods:
        kv(pod)     = 1 - kv_usage                   # kv-cache-utilization-scorer
        queue(pod)  = (max w - w) / (max w - min w), 1.0 when all equal, w = waiting
                                                     # queue-scorer
        score       = prefix_weight * prefix + kv_usage_weight * kv + queue_weight * queue
    the highest score wins; equal scores are drawn at random (max-score-picker).

Unscraped metrics count as llm-d's zero values (``waiting`` 0, ``kv_usage`` 0).  Pods the
filter drops get ``score - (sum of the weights)`` in ``Decision.scores`` (their scores
over all candidates), so they rank after every kept pod.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from pydantic import Field, field_validator

from scoring.index.base import DEFAULT_TIERS
from scoring.policies.base import Decision, PodView, Policy, PolicyParams, RouteRequest
from scoring.policies.precise_prefix import min_max, weighted_prefix
from scoring.policies.prefill_load import ActivePrefill
from scoring.policies.select import highest, require_candidates

# int(score) of a sum of tier weights: absorb the rounding of w * n (1e-9 of a block)
_EPS = 1e-9


def _unit(x: float) -> float:
    return 0.0 if x < 0.0 else 1.0 if x > 1.0 else x


class LlmdParams(PolicyParams):
    prefix_weight: float = Field(default=2.0, ge=0.0, allow_inf_nan=False)
    kv_usage_weight: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    queue_weight: float = Field(default=1.0, ge=0.0, allow_inf_nan=False)
    tier_weights: dict[str, float] = Field(default_factory=lambda: {"GPU": 1.0, "CPU": 0.8})
    tiers: tuple[str, ...] = DEFAULT_TIERS
    affinity_filter: bool = True
    affinity_threshold: float = Field(default=0.80, le=1.0, allow_inf_nan=False)
    exploration_probability: float = Field(default=0.01, ge=0.0, le=1.0)
    max_ttft_penalty_ms: float = Field(default=5000.0, ge=0.0, allow_inf_nan=False)
    peak_prefill_throughput_tokens_per_s: float = Field(
        default=15928.0, gt=0.0, allow_inf_nan=False
    )
    seed: int = 0

    @field_validator("tier_weights")
    @classmethod
    def _weights_non_negative(cls, v: dict[str, float]) -> dict[str, float]:
        for tier, w in v.items():
            if not 0.0 <= w < float("inf"):
                raise ValueError(f"tier weight for {tier!r} must be finite and >= 0, got {w}")
        return v


class LlmdPolicy(Policy):
    name = "llmd"
    Params = LlmdParams

    def __init__(self, params: PolicyParams | None = None) -> None:
        super().__init__(params)
        assert isinstance(self.params, LlmdParams)
        self._p: LlmdParams = self.params
        self._rng = random.Random(self._p.seed)
        # llm-d weighs a block held in a tier with no configured weight 1.0
        self._weights = {t: self._p.tier_weights.get(t, 1.0) for t in self._p.tiers}
        self._prefill = ActivePrefill()

    def match_blocks(self, view: PodView) -> int:
        return int(weighted_prefix(view.hits, self._p.tiers, self._weights) + _EPS)

    def ttft_ms(self, view: PodView) -> float:
        """The filter's TTFT estimate: in-flight uncached tokens / peak prefill rate."""
        return self._prefill.tokens(view) / self._p.peak_prefill_throughput_tokens_per_s * 1000

    def _filter(self, pods: Sequence[PodView], prefix: dict[str, float]) -> tuple[list[int], str]:
        """Indices of the pods ``prefix-cache-affinity-filter`` keeps, and why."""
        p = self._p
        every = list(range(len(pods)))
        if not p.affinity_filter or len(pods) <= 1 or p.affinity_threshold <= 0:
            return every, "off"
        if p.exploration_probability > 0 and self._rng.random() < p.exploration_probability:
            return every, "exploration"
        sticky = [i for i in every if prefix[pods[i].pod] >= p.affinity_threshold]
        if not sticky:
            return every, "no sticky pod"
        held = set(sticky)
        others = [i for i in every if i not in held]
        if p.max_ttft_penalty_ms > 0 and others:
            best_sticky = min(self.ttft_ms(pods[i]) for i in sticky)
            best_other = min(self.ttft_ms(pods[i]) for i in others)
            if best_sticky - best_other > p.max_ttft_penalty_ms:
                return every, "ttft gate"
        return sticky, "sticky"

    def _scores(self, pods: Sequence[PodView], prefix: dict[str, float]) -> dict[str, float]:
        """The weighted sum over ``pods``, each scorer's value clamped to [0, 1] as llm-d's
        scheduler profile does (``enforceScoreRange``)."""
        p = self._p
        queue = min_max({v.pod: float(v.waiting or 0) for v in pods}, low_is_good=True)
        return {
            v.pod: p.prefix_weight * _unit(prefix[v.pod])
            + p.kv_usage_weight * _unit(1.0 - (v.kv_usage or 0.0))
            + p.queue_weight * queue[v.pod]
            for v in pods
        }

    def pick(self, request: RouteRequest, pods: Sequence[PodView]) -> Decision:
        require_candidates(self.name, pods)
        total = len(request.block_keys)
        bs = max(1, request.block_size)
        prompt = max(0, request.prompt_tokens)
        match = {v.pod: self.match_blocks(v) for v in pods}
        prefix = {name: (n / total if total else 0.0) for name, n in match.items()}
        kept_i, reason = self._filter(pods, prefix)
        kept = [pods[i] for i in kept_i]
        scores = self._scores(kept, prefix)
        chosen, tied = highest(list(scores), list(scores.values()), self._rng)
        if len(kept) < len(pods):
            offset = self._p.prefix_weight + self._p.kv_usage_weight + self._p.queue_weight
            everyone = self._scores(pods, prefix)
            for v in pods:
                if v.pod not in scores:
                    scores[v.pod] = everyone[v.pod] - offset
        self._prefill.scored(
            request, {name: prompt - min(prompt, n * bs) for name, n in match.items()}
        )
        return Decision(
            pod=chosen,
            scores=scores,
            detail={
                "prefix": prefix,
                "filter": reason,
                "kept": [v.pod for v in kept],
                "tied": tied,
            },
        )

    def on_routed(self, request: RouteRequest, pod: str) -> None:
        self._prefill.routed(request, pod)

    def on_complete(self, request: RouteRequest, pod: str) -> None:
        self._prefill.complete(request)

    def on_pod_removed(self, pod: str) -> None:
        self._prefill.pod_removed(pod)
