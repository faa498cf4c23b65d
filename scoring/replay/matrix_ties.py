"""A matrix run under several tie seeds: how much of a cell is noise.

Most policies break exact ties (pods they score equal) by hashing the request id with
their ``seed``.  Which of two equal pods gets a request is not something a verdict
should hang on, so ``bench_quality_matrix.py --tie-seeds K`` replays the matrix once per
tie seed ``0 .. K-1`` (:func:`scoring.replay.matrix.run_cell`'s ``tie_seed``: every
policy with a ``seed`` parameter draws its ties again; tie seed 0 is the plain run) and
reports, for one policy:

* its issue #9 targets under each tie seed (:func:`scoring.replay.matrix_targets.targets`);
* per cell and trace seed, whether its TTFT p90 is within 1.05x of the best other
  policy's under *every* tie seed (a robust pass), under *none* (a robust miss) or under
  some (the verdict is the draw's);
* per cell and trace seed, each policy's TTFT p90 lowest and highest over the tie seeds.

A session-32 measurement (docs/history/quality_matrix.md, "Session 32") found ``cost``'s
p90 moving by more than 5% in 6 of 14 quick cells and by up to 1.43x under tie seeds
alone.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from scoring.replay.matrix_targets import P90_WITHIN, targets


def tie_targets(
    runs: Mapping[int, Sequence[dict[str, Any]]], seeds: Sequence[int], policy: str
) -> dict[int, dict[str, dict[str, Any]]]:
    """Tie seed -> :func:`targets` of ``policy`` over that run's cells."""
    return {tie: targets(results, seeds, policy) for tie, results in sorted(runs.items())}


def _key(r: dict[str, Any]) -> tuple[str, int]:
    return r["cell"], r["seed"]


def _by_cell(
    runs: Mapping[int, Sequence[dict[str, Any]]],
) -> dict[tuple[str, int], dict[int, dict[str, Any]]]:
    """(cell, trace seed) -> tie seed -> that cell's result (Mooncake repeats left out)."""
    out: dict[tuple[str, int], dict[int, dict[str, Any]]] = {}
    for tie, results in sorted(runs.items()):
        for r in results:
            if "same_as_seed" not in r:
                out.setdefault(_key(r), {})[tie] = r
    return out


def verdicts(
    runs: Mapping[int, Sequence[dict[str, Any]]], policy: str
) -> dict[tuple[str, int], list[float]]:
    """(cell, trace seed) -> ``policy``'s p90 over the best other policy's, per tie seed
    (in tie-seed order; cells where it or no other policy ran are left out)."""
    out: dict[tuple[str, int], list[float]] = {}
    for key, ties in _by_cell(runs).items():
        ratios: list[float] = []
        for r in ties.values():
            pols = r["policies"]
            others = [m["ttft_p90_s"] for p, m in pols.items() if p != policy]
            if policy not in pols or not others:
                break
            best = min(others)
            ratios.append(pols[policy]["ttft_p90_s"] / best if best > 0 else 1.0)
        else:
            if ratios:
                out[key] = ratios
    return out


def bands(
    runs: Mapping[int, Sequence[dict[str, Any]]],
) -> dict[tuple[str, int], dict[str, tuple[float, float]]]:
    """(cell, trace seed) -> policy -> (lowest, highest) TTFT p90 over the tie seeds."""
    out: dict[tuple[str, int], dict[str, tuple[float, float]]] = {}
    for key, ties in _by_cell(runs).items():
        p90s: dict[str, list[float]] = {}
        for r in ties.values():
            for p, m in r["policies"].items():
                p90s.setdefault(p, []).append(m["ttft_p90_s"])
        out[key] = {p: (min(xs), max(xs)) for p, xs in p90s.items()}
    return out


def ties_table(
    runs: Mapping[int, Sequence[dict[str, Any]]], seeds: Sequence[int], policy: str
) -> str:
    """Markdown: the targets per tie seed, the robust verdicts, the p90 bands."""
    figures = tie_targets(runs, seeds, policy)
    lines = [
        f"Tie seeds {', '.join(str(t) for t in sorted(runs))}: `{policy}`'s targets under each",
        "",
        "| tie seed | seed group | p90 within 1.05x | hit >= 0.95x | imbalance <= 1.25 "
        "| p90 geomean vs the best peer |",
        "|---:|---|---:|---:|---:|---|",
    ]
    for tie, groups in figures.items():
        for group, f in groups.items():
            peer = f"{f['vs_best_peer']:.2f}x ({f['best_peer']})" if f["best_peer"] else "no peer"
            n = f["compared"]
            lines.append(
                f"| {tie} | {group} | {f['p90_within']} / {n} | {f['hit_within']} / {n} "
                f"| {f['balanced']} / {f['balanced_cells']} | {peer} |"
            )
    v = verdicts(runs, policy)
    robust = sum(1 for xs in v.values() if max(xs) <= P90_WITHIN + 1e-9)
    never = sum(1 for xs in v.values() if min(xs) > P90_WITHIN + 1e-9)
    lines += [
        "",
        f"p90 within {P90_WITHIN}x of the best other policy under every tie seed: "
        f"{robust} of {len(v)} cells; under none: {never}; the draw's: "
        f"{len(v) - robust - never}.",
        "",
    ]
    b = bands(runs)
    policies = list(dict.fromkeys(p for row in b.values() for p in row))
    lines += [
        "TTFT p90 (s), lowest - highest over the tie seeds, and "
        f"`{policy}` / the best other (lowest - highest):",
        "",
        "| cell | seed | " + " | ".join(policies) + f" | `{policy}` / best other |",
        "|---|---:|" + "---:|" * (len(policies) + 1),
    ]
    for (cell, seed), row in sorted(b.items()):
        spans = ["-" if p not in row else f"{row[p][0]:.3g} - {row[p][1]:.3g}" for p in policies]
        ratio = v.get((cell, seed))
        r = "-" if ratio is None else f"{min(ratio):.2f} - {max(ratio):.2f}"
        lines.append(f"| {cell} | {seed} | " + " | ".join(spans) + f" | {r} |")
    return "\n".join(lines)
