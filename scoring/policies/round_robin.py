"""``round_robin``: the i-th request goes to candidate ``i mod n``.

Ignores cache state and load: the cache-blind baseline every other policy is compared
against.  The counter advances once per :meth:`pick`, over the candidate list in the
order the caller gives it.
"""

from __future__ import annotations

from collections.abc import Sequence

from scoring.policies.base import (
    Decision,
    NoCandidatesError,
    PodView,
    Policy,
    PolicyParams,
    RouteRequest,
)


class RoundRobinParams(PolicyParams):
    """No parameters."""


class RoundRobinPolicy(Policy):
    name = "round_robin"
    Params = RoundRobinParams

    def __init__(self, params: PolicyParams | None = None) -> None:
        super().__init__(params)
        self._next = 0

    def pick(self, request: RouteRequest, pods: Sequence[PodView]) -> Decision:
        if not pods:
            raise NoCandidatesError("round_robin: no candidate pods")
        i = self._next % len(pods)
        self._next += 1
        chosen = pods[i].pod
        return Decision(pod=chosen, scores={p.pod: float(p.pod == chosen) for p in pods})
