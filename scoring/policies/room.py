"""Free KV room as vLLM counts it, from what a :class:`PodView` carries.

vLLM's ``kv_cache_usage_perc`` counts the blocks running requests hold; cached blocks
no running request holds are free (evicted LRU when room is needed), so a pod whose
cache is full of old prefixes is not a full pod.
"""

from __future__ import annotations

import math

from scoring.policies.base import PodView


def free_blocks(view: PodView) -> float | None:
    """Free KV room as vLLM has it (blocks not held by running requests), or ``None``:
    ``capacity * (1 - kv_usage)``; without a usage ``capacity - resident``; without a
    capacity ``None``."""
    cap = view.capacity_blocks
    if cap is None:
        return None
    usage = view.kv_usage
    if usage is not None and math.isfinite(usage):
        return cap * (1.0 - min(1.0, max(0.0, usage)))
    if view.resident_blocks is not None:
        return float(cap - view.resident_blocks)
    return None
