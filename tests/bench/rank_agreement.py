"""How far two orderings of the same items agree (bench_live_vs_replay.py)."""

from __future__ import annotations

import math
from collections.abc import Sequence


def kendall_tau_b(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Kendall's tau-b of paired values: +1 the same order, -1 reversed, ties counted as
    neither concordant nor discordant and corrected for.  NaN if either side is all ties."""
    if len(xs) != len(ys):
        raise ValueError(f"kendall_tau_b: {len(xs)} values against {len(ys)}")
    concordant = discordant = ties_x = ties_y = 0
    n = len(xs)
    for i in range(n):
        for j in range(i + 1, n):
            dx, dy = xs[i] - xs[j], ys[i] - ys[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                ties_x += 1
            elif dy == 0:
                ties_y += 1
            elif (dx > 0) == (dy > 0):
                concordant += 1
            else:
                discordant += 1
    denom = math.sqrt((concordant + discordant + ties_x) * (concordant + discordant + ties_y))
    return (concordant - discordant) / denom if denom else float("nan")


def pair_agreement(ref: Sequence[float], other: Sequence[float], margin: float) -> dict[str, int]:
    """Of the pairs ``ref`` separates by more than ``margin`` (relative to the larger of
    the two), how many ``other`` orders the same way (a tie in ``other`` does not agree)."""
    pairs = agree = 0
    for i in range(len(ref)):
        for j in range(i + 1, len(ref)):
            a, b = ref[i], ref[j]
            if abs(a - b) <= margin * max(abs(a), abs(b)):
                continue
            pairs += 1
            d = other[i] - other[j]
            agree += d != 0 and (d > 0) == (a > b)
    return {"pairs": pairs, "agree": agree}
