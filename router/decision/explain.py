"""``POST /v1/route``: where a request would go and why, every candidate's view and score
(every field, its unit and how to read it: docs/route.md).

``cached_blocks`` are a pod's hits per tier as the policy saw them; of its GPU blocks,
``speculative_blocks`` come from speculative entries (routed there, not announced by its
KV events: router/decision/learning.py), the rest from the index.  ``/v1/route``
itself sends nothing, so it writes no speculative entry."""

from __future__ import annotations

from typing import Any

from router.decision.disagg import PDPlan
from router.decision.request import Routed
from router.fleet.pods import PodRegistry
from scoring.index.base import DEFAULT_TIERS


def shown_tiers(hits: dict[str, int]) -> dict[str, int]:
    """A pod's cumulative hits per tier as shown: ``GPU``, and each slower tier only
    where it adds blocks (its count above the next faster tier's).  A GPU-only engine's
    ``{"GPU": 25, "CPU": 25, "DISK": 25}`` shows as ``{"GPU": 25}``; an empty view
    (no leading block anywhere) as ``{}``."""
    if not hits:
        return {}
    order = [t for t in DEFAULT_TIERS if t in hits or t == "GPU"]
    order += [t for t in hits if t not in DEFAULT_TIERS]
    shown: dict[str, int] = {}
    faster = 0
    for tier in order:
        n = hits.get(tier, faster)
        if tier == "GPU" or n > faster:
            shown[tier] = n
        faster = max(faster, n)
    return shown


def explain(routed: Routed, registry: PodRegistry, policy: str) -> dict[str, Any]:
    """The body of ``POST /v1/route``."""
    scores = routed.decision.scores
    candidates = []
    # a P/D plan ranks the decode pods: the prefill-only pods follow, unranked
    pods = [*routed.ranking, *(p for p in routed.views if p not in routed.ranking)]
    for pod in pods:
        v = routed.views[pod]
        state = registry.get(pod)
        candidates.append(
            {
                "pod": pod,
                "url": state.spec.url if state else None,
                "cached_blocks": shown_tiers(v.hits),
                "speculative_blocks": v.speculative,
                "cached_tokens": routed.cached_tokens(pod),
                "inflight": v.inflight,
                "outstanding_prefill_tokens": v.outstanding_prefill_tokens,
                "waiting": v.waiting,
                "running": v.running,
                "kv_usage": v.kv_usage,
                "resident_blocks": v.resident_blocks,
                "capacity_blocks": v.capacity_blocks,
                "score": scores.get(pod),
            }
        )
    out = {
        "pod": routed.decision.pod,
        "policy": policy,
        "model": routed.model,
        "lora": routed.route.lora,
        "prompt_tokens": routed.route.prompt_tokens,
        "block_size": routed.route.block_size,
        "blocks": len(routed.route.block_keys),
        "tokenizer": routed.tokenizer_name,
        "approximate": routed.approximate,
        "lower_is_better": routed.decision.lower_is_better,
        "candidates": candidates,
        "detail": routed.decision.detail,
    }
    if routed.pd is not None:
        out["pd"] = explain_pd(routed.pd)
    return out


def explain_pd(plan: PDPlan) -> dict[str, Any]:
    """The three choices of a model with roles: the decode pod (by decode score, lower is
    better), the prefill pod (the prefill policy's decision over the prefill pool less
    the decode pod), and whether to split (``reason``, with the predictions behind it)."""
    d = plan.decision
    prefill = d.prefill
    return {
        "split": plan.split,
        "reason": d.reason,
        "decode_pod": d.decode_pod,
        "decode_ranking": plan.decode_ranking,
        "decode_scores": d.decode_scores,
        "prefill_pod": d.prefill_pod,
        "prefill_ranking": plan.prefill_ranking,
        "prefill_candidate": None if prefill is None else prefill.pod,
        "prefill_scores": None if prefill is None else prefill.scores,
        "prefill_lower_is_better": None if prefill is None else prefill.lower_is_better,
        "predicted": d.predicted,
        "roles": plan.roles,
    }
