"""``POST /v1/route``: where a request would go and why, every candidate's view and score.

``cached_blocks`` are a pod's hits per tier as the policy saw them; of its GPU blocks,
``speculative_blocks`` come from speculative entries (routed there, not announced by its
KV events: router/decision/learning.py), the rest from the index.  ``/v1/route``
itself sends nothing, so it writes no speculative entry."""

from __future__ import annotations

from typing import Any

from router.decision.request import Routed
from router.fleet.pods import PodRegistry


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
                "cached_blocks": dict(v.hits),
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
