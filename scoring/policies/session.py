"""``session``: consistent hashing on the session id, with bounded loads.

Each pod owns ``virtual_nodes`` points on a 64-bit ring (xxh3 of ``"<pod>#<i>"``).  A
request with a session id hashes to a point and walks the ring clockwise to the first
pod whose load is under the bound (Mirrokni, Thorup, Zadimoghaddam, *Consistent
Hashing with Bounded Loads*, 2018)::

    bound = ceil(load_factor * (sum of inflight over candidates + 1) / n_candidates)
    accept pod  iff  pod.inflight + 1 <= bound

so no pod holds more than ``load_factor`` times the mean (``c = 1.25`` by default) and a
session keeps its pod while that pod is not overloaded.  The ring is rebuilt only when
the candidate set changes, so adding or removing one pod moves ~1/n of the sessions.

Requests **without** a session id fall back to :mod:`least_load` (fewest outstanding
prefill tokens, then fewest in-flight, seeded random tie-break).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

import xxhash
from pydantic import Field

from scoring.policies.base import Decision, PodView, Policy, PolicyParams, RouteRequest
from scoring.policies.least_load import LeastLoadParams, LeastLoadPolicy
from scoring.policies.select import require_candidates

_h64 = xxhash.xxh3_64_intdigest


class SessionParams(PolicyParams):
    load_factor: float = Field(default=1.25, ge=1.0, description="c: max load / mean load")
    virtual_nodes: int = Field(default=160, ge=1, le=10_000, description="ring points per pod")
    seed: int = Field(default=0, description="seed of the no-session fallback's tie-break")


class SessionPolicy(Policy):
    name = "session"
    Params = SessionParams

    def __init__(self, params: PolicyParams | None = None) -> None:
        super().__init__(params)
        assert isinstance(self.params, SessionParams)
        self._p: SessionParams = self.params
        self._fallback = LeastLoadPolicy(LeastLoadParams(seed=self._p.seed))
        self._ring_for: frozenset[str] = frozenset()
        self._ring_points: list[int] = []
        self._ring_pods: list[str] = []

    def _ring(self, names: frozenset[str]) -> tuple[list[int], list[str]]:
        if names != self._ring_for:
            points = sorted(
                (_h64(f"{name}#{i}".encode()), name)
                for name in names
                for i in range(self._p.virtual_nodes)
            )
            self._ring_points = [h for h, _ in points]
            self._ring_pods = [n for _, n in points]
            self._ring_for = names
        return self._ring_points, self._ring_pods

    def pick(self, request: RouteRequest, pods: Sequence[PodView]) -> Decision:
        require_candidates(self.name, pods)
        if not request.session:
            decision = self._fallback.pick(request, pods)
            decision.detail["fallback"] = "least_load (no session id)"
            return decision
        by_name = {p.pod: p for p in pods}
        points, owners = self._ring(frozenset(by_name))
        total = sum(p.inflight for p in pods)
        bound = math.ceil(self._p.load_factor * (total + 1) / len(pods))
        start = bisect.bisect_left(points, _h64(request.session.encode()))
        chosen: str | None = None
        skipped: list[str] = []
        seen: set[str] = set()
        for step in range(len(points)):
            name = owners[(start + step) % len(points)]
            if name in seen:
                continue
            seen.add(name)
            if by_name[name].inflight + 1 <= bound:
                chosen = name
                break
            skipped.append(name)
        if chosen is None:  # unreachable: the least loaded pod is always under the bound
            chosen = min(pods, key=lambda p: p.inflight).pod
        return Decision(
            pod=chosen,
            scores={p.pod: float(p.pod == chosen) for p in pods},
            detail={"bound": bound, "skipped_overloaded": skipped},
        )
