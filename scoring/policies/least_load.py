"""``least_load``: the pod with the least router-tracked load, ties broken at random.

Load is compared as the tuple ``(outstanding_prefill_tokens, inflight)`` (``metric:
prefill_tokens``, the default) or ``(inflight, outstanding_prefill_tokens)`` (``metric:
inflight``); pods whose tuples are equal are tied and one is drawn uniformly with a
seeded RNG, so the first candidate is never favoured.  Score reported per pod:
``-primary`` (higher is better).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Literal

from pydantic import Field

from scoring.policies.base import Decision, PodView, Policy, PolicyParams, RouteRequest
from scoring.policies.select import lowest, require_candidates


class LeastLoadParams(PolicyParams):
    metric: Literal["prefill_tokens", "inflight"] = "prefill_tokens"
    seed: int = Field(default=0, description="seed of the tie-break RNG")


def load_key(pod: PodView, metric: str) -> tuple[int, int]:
    """The load tuple compared by :class:`LeastLoadPolicy` (smaller is less loaded)."""
    if metric == "inflight":
        return (pod.inflight, pod.outstanding_prefill_tokens)
    return (pod.outstanding_prefill_tokens, pod.inflight)


class LeastLoadPolicy(Policy):
    name = "least_load"
    Params = LeastLoadParams

    def __init__(self, params: PolicyParams | None = None) -> None:
        super().__init__(params)
        assert isinstance(self.params, LeastLoadParams)
        self._p: LeastLoadParams = self.params
        self._rng = random.Random(self._p.seed)

    def pick(self, request: RouteRequest, pods: Sequence[PodView]) -> Decision:
        require_candidates(self.name, pods)
        keys = [load_key(p, self._p.metric) for p in pods]
        chosen, tied = lowest(pods, keys, self._rng)
        return Decision(
            pod=chosen.pod,
            scores={p.pod: -float(k[0]) for p, k in zip(pods, keys, strict=True)},
            detail={"metric": self._p.metric, "tied": tied},
        )
