"""Issue #9's targets for one policy over a matrix run (:mod:`scoring.replay.matrix`).

For the *tuning* seed (``seeds[0]``) and the *held-out* seeds (the rest), each cell
counted once (a Mooncake cell repeated from the tuning seed is left out of the held-out
group, as :func:`scoring.replay.matrix_summary.summarize` does):

* ``cells`` — the cells the policy ran in; ``compared`` — those where another policy
  ran too, the denominator of the counts below;
* ``vs_best_peer`` — the geometric mean of TTFT p90 / the cell's best (every policy in
  the run) of the best *peer* (the lowest such geomean among ``peers``) over the
  policy's own: the target is >= 1.3;
* ``p90_within`` — cells where the policy's p90 is within 1.05x of the best *other*
  policy's (every policy but itself);
* ``hit_within`` — cells where its hit rate is >= 0.95x the best other's;
* ``balanced`` / ``balanced_cells`` — cells where its imbalance is <= 1.25, among the
  cells where some other policy's is;
* ``misses`` — the cells failing the p90 target, worst first: ``(ratio, cell, seed)``.

:func:`leave_out` drops rows from the comparison first, e.g. ``cost`` when the policy
judged is a variant of it that should meet the peers alone.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from scoring.replay.matrix_summary import geomean

PEERS = ("approx_prefix", "precise_prefix", "dynamo", "llmd")
P90_WITHIN = 1.05
HIT_WITHIN = 0.95
IMBALANCE = 1.25


def leave_out(
    results: Sequence[dict[str, Any]], names: Sequence[str], keep: str
) -> list[dict[str, Any]]:
    """``results`` with the rows ``names`` removed from every cell (``keep``, the policy
    judged, stays even if named), so that ``keep`` is compared with the rest only."""
    drop = set(names) - {keep}
    if not drop:
        return list(results)
    return [
        {**r, "policies": {p: m for p, m in r["policies"].items() if p not in drop}}
        for r in results
    ]


def targets(
    results: Sequence[dict[str, Any]],
    seeds: Sequence[int],
    policy: str,
    peers: Sequence[str] = PEERS,
) -> dict[str, dict[str, Any]]:
    """Per seed group (``tuning``, ``held_out``), the target figures for ``policy``."""
    out: dict[str, dict[str, Any]] = {}
    for group, members in (("tuning", seeds[:1]), ("held_out", seeds[1:])):
        rows = [
            r
            for r in results
            if r["seed"] in members and "same_as_seed" not in r and policy in r["policies"]
        ]
        if not rows:
            continue
        ratios: dict[str, list[float]] = {p: [] for p in (policy, *peers)}
        p90_ok = hit_ok = bal_ok = bal_cells = compared = 0
        misses: list[tuple[float, str, int]] = []
        for r in rows:
            pols = r["policies"]
            best = min(m["ttft_p90_s"] for m in pols.values())
            for p in ratios:
                if p in pols and best > 0:
                    ratios[p].append(pols[p]["ttft_p90_s"] / best)
            me = pols[policy]
            others = [m for p, m in pols.items() if p != policy]
            if not others:
                continue
            compared += 1
            best_other = min(m["ttft_p90_s"] for m in others)
            ratio = me["ttft_p90_s"] / best_other if best_other > 0 else 1.0
            if ratio <= P90_WITHIN + 1e-9:
                p90_ok += 1
            else:
                misses.append((ratio, r["cell"], r["seed"]))
            if me["hit_rate"] >= HIT_WITHIN * max(m["hit_rate"] for m in others) - 1e-12:
                hit_ok += 1
            if min(m["imbalance"] for m in others) <= IMBALANCE:
                bal_cells += 1
                bal_ok += me["imbalance"] <= IMBALANCE
        peer_means = {p: geomean(ratios[p]) for p in peers if ratios[p]}
        best_peer = min(peer_means, key=lambda p: peer_means[p]) if peer_means else None
        own = geomean(ratios[policy])
        out[group] = {
            "cells": len(rows),
            "compared": compared,
            "geomean": own,
            "best_peer": best_peer,
            "best_peer_geomean": peer_means.get(best_peer) if best_peer else None,
            "vs_best_peer": peer_means[best_peer] / own if best_peer else None,
            "p90_within": p90_ok,
            "hit_within": hit_ok,
            "balanced": bal_ok,
            "balanced_cells": bal_cells,
            "misses": sorted(misses, reverse=True),
        }
    return out


def targets_table(policy: str, figures: dict[str, dict[str, Any]]) -> str:
    """The figures of :func:`targets` as a Markdown table, one column per seed group."""
    groups = [g for g in ("tuning", "held_out") if g in figures]
    names = {"tuning": "tuning seed", "held_out": "held-out seeds"}

    def col(g: str, row: str) -> str:
        f = figures[g]
        n = f["compared"]
        if row == "peer":
            return (
                f"{f['vs_best_peer']:.2f}x ({f['best_peer']} {f['best_peer_geomean']:.2f} "
                f"/ {f['geomean']:.2f})"
                if f["best_peer"]
                else "no peer in the run"
            )
        if n == 0:
            return "no other policy in the run"
        if row == "p90":
            worst = ", ".join(f"{c} s{s} {x:.2f}x" for x, c, s in f["misses"][:3])
            return f"{f['p90_within']} / {n}" + (f" (worst: {worst})" if worst else "")
        if row == "hit":
            return f"{f['hit_within']} / {n}"
        return f"{f['balanced']} / {f['balanced_cells']}"

    rows = [
        ("peer", "p90 geomean vs the best peer's (target >= 1.3x)"),
        ("p90", "p90 within 1.05x of the best other policy (every cell)"),
        ("hit", "hit rate >= 0.95x the best other's (every cell)"),
        ("imb", "imbalance <= 1.25 where another policy reaches it"),
    ]
    lines = [
        f"Targets for `{policy}` (issue #9):",
        "",
        "| target | " + " | ".join(names[g] for g in groups) + " |",
        "|---|" + "---|" * len(groups),
    ]
    lines += [
        f"| {label} | " + " | ".join(col(g, key) for g in groups) + " |" for key, label in rows
    ]
    return "\n".join(lines)
