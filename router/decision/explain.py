"""``POST /v1/route``: where a request would go and why, every candidate's view and score
(every field, its unit and how to read it: docs/route.md)."""

from __future__ import annotations

from typing import Any

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
    for pod in routed.ranking:
        v = routed.views[pod]
        state = registry.get(pod)
        candidates.append(
            {
                "pod": pod,
                "url": state.spec.url if state else None,
                "cached_blocks": shown_tiers(v.hits),
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
    return {
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
