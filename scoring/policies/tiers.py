"""What a pod's per-tier hits are worth to a prompt: the tokens servable from the fastest
tier with a load rate, and the seconds to load the slower tiers' share into GPU memory
(the ``cost`` and ``measured`` policies price cached blocks this way)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def tier_hits(
    hits: Mapping[str, int],
    prompt: int,
    bs: int,
    tiers: Sequence[str],
    rates: Mapping[str, float],
) -> tuple[int, float]:
    """(prompt tokens servable from the fastest tier with a rate, seconds to load the
    slower tiers' share into GPU memory) for one pod's ``hits``."""
    cached = 0
    transfer = 0.0
    first = True
    for tier in tiers:
        n = hits.get(tier)
        if n is None:
            first = False
            continue
        tok = min(n * bs, prompt)
        if tok > cached:
            if first:
                cached = tok
            else:
                rate = rates.get(tier)
                if rate is None:
                    first = False
                    continue
                transfer += (tok - cached) / rate
                cached = tok
        first = False
    return cached, transfer
