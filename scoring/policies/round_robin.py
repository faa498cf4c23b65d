"""``round_robin``: the i-th request goes to candidate ``i mod n``.

Ignores cache state and load: the cache-blind baseline every other policy is compared
against.  The counter advances once per :meth:`pick`, over the candidate list in the
order the caller gives it.
"""

from __future__ import annotations

from collections.abc import Sequence

from scoring.policies.base import Decision, PodView, Policy, PolicyParams, RouteRequest
from scoring.policies.select import require_candidates


class RoundRobinParams(PolicyParams):
    """No parameters."""


class RoundRobinPolicy(Policy):
    name = "round_robin"
    Params = RoundRobinParams

    def __init__(self, params: PolicyParams | None = None) -> None:
        super().__init__(params)
        self._next = 0

    def pick(self, request: RouteRequest, pods: Sequence[PodView]) -> Decision:
        require_candidates(self.name, pods)
        i = self._next % len(pods)
        self._next += 1
        chosen = pods[i].pod
        return Decision(pod=chosen, scores={p.pod: float(p.pod == chosen) for p in pods})
