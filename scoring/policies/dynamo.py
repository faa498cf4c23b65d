"""``dynamo``: NVIDIA Dynamo's KV router cost, from its published source and docs
(``ai-dynamo/dynamo`` lib/kv-router/src/scheduling/selector/default.rs and mod.rs,
config.rs; docs/components/router/router-concepts.md, router-configuration.md).

Per candidate worker, with ``P`` prompt tokens, block size ``B`` and ``hits[t]`` =
leading blocks servable from tier ``t`` or faster::

    active        = uncached prompt tokens of the requests routed here still in prefill
                    (scoring.policies.prefill_load; Dynamo's active_prefill_tokens)
    raw           = (active + P) / B                                 # raw_prefill_blocks
    decay         = 1 / (1 + overlap_score_credit_decay
                         * ((active - min active) / B) / ceil(P / B))
    credit        = overlap_score_credit * decay * device      # device = hits[GPU]
                    + host_cache_hit_weight * host             # host = hits[CPU] - hits[GPU]
                    + disk_cache_hit_weight * disk             # disk = hits[DISK] - hits[CPU]
    adjusted      = max(raw - credit, 0)                        # adjusted_prefill_blocks
    decode        = distinct block keys of the live requests routed here
                    + this request's block keys not among them  # potential_decode_blocks
    linear:  cost = prefill_load_scale * adjusted + decode
                    + decode_active_request_weight * inflight
    lmetric: cost = adjusted * (decode + 1)

The lowest cost wins; exact ties are drawn at random (seeded).  With
``router_temperature > 0`` the worker is sampled with probability proportional to
``exp(-(cost - min) / ((max - min) * temperature))`` (softmax over min-max normalised
costs; uniform when all costs are equal).  ``Decision.scores`` holds the costs
(``lower_is_better``).

Dynamo tracks its active load from its own routing, per router replica: ``decode`` from
the block hashes of the requests it added and has not freed (``router_track_active_blocks``,
prompt blocks only — output-block tracking is off by default and not modelled), ``active``
from each request's ``isl - cached`` until its first token.  Here ``decode`` is this
policy's own ledger (on_routed .. on_complete) and ``active`` is the
:class:`~scoring.policies.prefill_load.ActivePrefill` reconstruction from
``outstanding_prefill_tokens``; each request's uncached tokens are ``P - min(P, credit * B)``
for the worker it was routed to.  ``inflight`` stands in for Dynamo's ``active_requests``.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Literal

from pydantic import Field

from scoring.policies.base import Decision, PodView, Policy, PolicyParams, RouteRequest
from scoring.policies.precise_prefix import weighted_prefix
from scoring.policies.prefill_load import ActivePrefill, Key, request_key
from scoring.policies.select import lowest, require_candidates


def _weight(default: float, *, le: float | None = None) -> float:
    return Field(default=default, ge=0.0, le=le, allow_inf_nan=False)


class DynamoParams(PolicyParams):
    overlap_score_credit: float = _weight(1.0)
    overlap_score_credit_decay: float = _weight(0.0)
    prefill_load_scale: float = _weight(1.0)
    host_cache_hit_weight: float = _weight(0.75, le=1.0)
    disk_cache_hit_weight: float = _weight(0.25, le=1.0)
    decode_active_request_weight: float = _weight(0.0)
    router_temperature: float = _weight(0.0)
    selection_policy: Literal["linear", "lmetric"] = "linear"
    track_prefill_tokens: bool = True
    track_active_blocks: bool = True
    device_tier: str = "GPU"
    host_tier: str = "CPU"
    disk_tier: str = "DISK"
    seed: int = 0


def softmax_pick(costs: Sequence[float], temperature: float, sample: float) -> int:
    """Dynamo's sampling: the index drawn by ``sample`` in [0, 1) from the softmax of the
    min-max normalised negated costs at ``temperature`` (> 0)."""
    lo, hi = min(costs), max(costs)
    if hi == lo:
        return min(int(sample * len(costs)), len(costs) - 1)
    scale = 1.0 / ((hi - lo) * temperature)
    weights = [math.exp(-(c - lo) * scale) for c in costs]
    total = sum(weights)
    cumulative = 0.0
    for i, w in enumerate(weights):
        cumulative += w / total
        if sample <= cumulative:
            return i
    return len(costs) - 1


class DynamoPolicy(Policy):
    name = "dynamo"
    Params = DynamoParams

    def __init__(self, params: PolicyParams | None = None) -> None:
        super().__init__(params)
        assert isinstance(self.params, DynamoParams)
        self._p: DynamoParams = self.params
        self._rng = random.Random(self._p.seed)
        self._tiers = (self._p.device_tier, self._p.host_tier, self._p.disk_tier)
        self._prefill = ActivePrefill()
        # pod -> block key -> live requests routed there that carry it
        self._active_blocks: dict[str, dict[int, int]] = {}
        # key -> (pod, block keys), while live
        self._live: dict[Key, tuple[str, tuple[int, ...]]] = {}

    def decode_blocks(self, pod: str, keys: Sequence[int]) -> int:
        """Distinct blocks of the live requests on ``pod`` plus ``keys`` not among them."""
        active = self._active_blocks.get(pod, {})
        return len(active) + sum(1 for k in set(keys) if k not in active)

    def pick(self, request: RouteRequest, pods: Sequence[PodView]) -> Decision:
        require_candidates(self.name, pods)
        p = self._p
        bs = max(1, request.block_size)
        isl = max(0, request.prompt_tokens)
        request_blocks = max(1, -(-isl // bs))
        keys = request.block_keys
        active = [self._prefill.tokens(v) if p.track_prefill_tokens else 0.0 for v in pods]
        floor = min(active)
        host_disk = {p.host_tier: p.host_cache_hit_weight, p.disk_tier: p.disk_cache_hit_weight}
        costs: list[float] = []
        uncached: dict[str, int] = {}
        rows: dict[str, dict[str, float]] = {}
        for view, load in zip(pods, active, strict=True):
            decay = 1.0
            if p.track_prefill_tokens and p.overlap_score_credit_decay > 0:
                excess = (load - floor) / bs / request_blocks
                decay = 1.0 / (1.0 + p.overlap_score_credit_decay * excess)
            weights = {p.device_tier: p.overlap_score_credit * decay, **host_disk}
            credit = weighted_prefix(view.hits, self._tiers, weights)
            raw = (load + isl) / bs if p.track_prefill_tokens else 0.0
            adjusted = max(raw - credit, 0.0)
            decode = float(self.decode_blocks(view.pod, keys)) if p.track_active_blocks else 0.0
            if p.selection_policy == "lmetric":
                cost = adjusted * (decode + 1.0)
            else:
                cost = (
                    p.prefill_load_scale * adjusted
                    + decode
                    + p.decode_active_request_weight * view.inflight
                )
            costs.append(cost)
            uncached[view.pod] = isl - min(isl, int(credit * bs))
            rows[view.pod] = {
                "active_prefill_tokens": load,
                "raw_prefill_blocks": raw,
                "overlap_credit_blocks": credit,
                "adjusted_prefill_blocks": adjusted,
                "decode_blocks": decode,
            }
        names = [v.pod for v in pods]
        if p.router_temperature > 0:
            chosen = names[softmax_pick(costs, p.router_temperature, self._rng.random())]
            tied = 1
        else:
            chosen, tied = lowest(names, costs, self._rng)
        self._prefill.scored(request, uncached)
        return Decision(
            pod=chosen,
            scores=dict(zip(names, costs, strict=True)),
            lower_is_better=True,
            detail={"formula": p.selection_policy, "tied": tied, "workers": rows},
        )

    def on_routed(self, request: RouteRequest, pod: str) -> None:
        self.on_complete(request, pod)  # routed again (a retry): forget the first attempt
        self._prefill.routed(request, pod)
        keys = tuple(request.block_keys)
        self._live[request_key(request)] = (pod, keys)
        active = self._active_blocks.setdefault(pod, {})
        for k in set(keys):
            active[k] = active.get(k, 0) + 1

    def on_complete(self, request: RouteRequest, pod: str) -> None:
        self._prefill.complete(request)
        live = self._live.pop(request_key(request), None)
        if live is None:
            return
        where, keys = live
        active = self._active_blocks.get(where)
        if active is None:
            return
        for k in set(keys):
            n = active.get(k, 0) - 1
            if n > 0:
                active[k] = n
            else:
                active.pop(k, None)

    def on_pod_removed(self, pod: str) -> None:
        self._prefill.pod_removed(pod)
        self._active_blocks.pop(pod, None)
        for key in [k for k, (where, _) in self._live.items() if where == pod]:
            del self._live[key]
