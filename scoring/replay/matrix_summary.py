"""A matrix run's summary per policy (:mod:`scoring.replay.matrix`): the tuning seed's
cells next to the held-out seeds'."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

#: a policy's TTFT p90 counts as the cell's best within this ratio of it
WITHIN = 1.05


def geomean(xs: Sequence[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def summarize(results: Sequence[dict[str, Any]], seeds: Sequence[int]) -> dict[str, Any]:
    """Per policy, for the tuning seed (``seeds[0]``), the held-out seeds (the rest) and
    all: cells, geometric mean of TTFT p90 / best, cells within 1.05x of the best, the
    worst ratio and its cell, mean hit rate / pooled ceiling, geometric mean of the
    end-to-end p90 / best.  A result repeated from the tuning seed (``same_as_seed``: a
    Mooncake cell) counts once, for the tuning seed: held-out groups hold only traces
    the tuning seed did not see."""
    groups = {"tuning": list(seeds[:1]), "held_out": list(seeds[1:]), "all": list(seeds)}
    policies = list(dict.fromkeys(p for r in results for p in r["policies"]))
    out: dict[str, Any] = {
        "seeds": {"tuning": seeds[0] if seeds else None, "held_out": list(seeds[1:])},
        "policies": {},
    }
    for pol in policies:
        row: dict[str, Any] = {}
        for group, members in groups.items():
            rows = [
                (r["cell"], r["seed"], r["policies"][pol])
                for r in results
                if r["seed"] in members and pol in r["policies"] and "same_as_seed" not in r
            ]
            if not rows:
                continue
            ratios = [m["p90_vs_best"] for _, _, m in rows]
            worst = max(rows, key=lambda x: x[2]["p90_vs_best"])
            pooled = [m["of_pooled"] for _, _, m in rows if m["of_pooled"] is not None]
            e2e = [m["e2e_p90_vs_best"] for _, _, m in rows if "e2e_p90_vs_best" in m]
            row[group] = {
                "cells": len(rows),
                "p90_vs_best_geomean": geomean(ratios),
                "within_1_05": sum(1 for x in ratios if x <= WITHIN + 1e-9),
                "worst_p90_vs_best": worst[2]["p90_vs_best"],
                "worst_cell": f"{worst[0]} (seed {worst[1]})",
                "of_pooled_mean": sum(pooled) / len(pooled) if pooled else None,
                # end to end (what JSON clients wait), over the cells that measured it
                "e2e_p90_vs_best_geomean": geomean(e2e) if e2e else None,
            }
        out["policies"][pol] = row
    return out
