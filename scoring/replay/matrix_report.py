"""Markdown for the benchmark matrix (:mod:`scoring.replay.matrix`): the per-policy
summary (tuning seed next to held-out seeds) and one row per cell, seed and policy."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from scoring.replay.matrix_summary import WITHIN


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def summary_table(summary: dict[str, Any]) -> str:
    """One row per policy; a column group per seed group that has cells."""
    seeds = summary["seeds"]
    groups = [("tuning", f"tuning seed {seeds['tuning']}")]
    if seeds["held_out"]:
        held = ", ".join(str(s) for s in seeds["held_out"])
        groups.append(
            ("held_out", f"held-out seed{'s' if len(seeds['held_out']) > 1 else ''} {held}")
        )
    head = ["policy"]
    for _, label in groups:
        head += [
            f"p90/best geomean ({label})",
            f"cells within {WITHIN:.2f}x",
            "worst p90/best (cell)",
            "hit / pooled (mean)",
        ]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|---:|---|---:|" * len(groups)]
    for pol, row in summary["policies"].items():
        cells = [pol]
        for key, _ in groups:
            g = row.get(key)
            if g is None:
                cells += ["-"] * 4
                continue
            cells += [
                f"{g['p90_vs_best_geomean']:.2f}",
                f"{g['within_1_05']} / {g['cells']}",
                f"{g['worst_p90_vs_best']:.2f} ({g['worst_cell']})",
                _pct(g["of_pooled_mean"]),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


CELL_COLUMNS = (
    "cell",
    "seed",
    "requests",
    "pooled ceiling",
    "policy",
    "hit rate",
    "of pooled",
    "TTFT p50 / best",
    "TTFT p90 / best",
    "TTFT p99 / best",
    "TTFT p90 (s)",
    "e2e p90 (s)",
    "prefill busy / capacity",
    "imbalance",
    "preemptions",
)


def _count(n: int | None) -> str:
    """A count, or blank where the run did not record it (an older run's JSON)."""
    return "" if n is None else f"{n:,}"


def _seconds(x: float | None) -> str:
    """Seconds, or blank where the run did not record them (an older run's JSON)."""
    return "" if x is None else f"{x:.2f}"


def cell_table(results: Sequence[dict[str, Any]]) -> str:
    """One row per (cell, seed, policy); ratios are to the cell's best policy (1.00)."""
    lines = [
        "| " + " | ".join(CELL_COLUMNS) + " |",
        "|---|---:|---:|---:|---|" + "---:|" * (len(CELL_COLUMNS) - 5),
    ]
    for r in results:
        pooled = _pct(r["ceilings"]["pooled"])
        seed = f"{r['seed']} (= {r['same_as_seed']})" if "same_as_seed" in r else str(r["seed"])
        for pol, m in r["policies"].items():
            lines.append(
                f"| {r['cell']} | {seed} | {r['requests']:,} | {pooled} "
                f"| {pol} | {m['hit_rate']:.1%} | {_pct(m['of_pooled'])} "
                f"| {m['p50_vs_best']:.2f} | {m['p90_vs_best']:.2f} | {m['p99_vs_best']:.2f} "
                f"| {m['ttft_p90_s']:.2f} | {_seconds(m.get('e2e_p90_s'))} "
                f"| {m['busy_vs_capacity']:.2f} | {m['imbalance']:.2f} "
                f"| {_count(m.get('preemptions'))} |"
            )
    return "\n".join(lines)


def markdown(doc: dict[str, Any]) -> str:
    """The whole report: how it was run, the summary, every cell."""
    run = doc["run"]
    held = ", ".join(str(s) for s in run["seeds"][1:]) or "none"
    engine = f" (engine `{run['preset']}`)" if "preset" in run else ""
    return "\n".join(
        [
            "# Routing quality matrix",
            "",
            f"`{run['command']}`",
            "",
            f"Seeds: tuning {run['seeds'][0]}, held out {held} (the Mooncake traces are the "
            "same for every seed: replayed once, shown under each seed as `s (= tuning)`, "
            f"summarised with the tuning seed only).  {len(doc['cells'])} cell results, "
            f"{len(run['policies'])} policies ({', '.join(run['policies'])}), "
            f"block size {run['block_size']}, pod model `{run['pod_model']}`{engine}, "
            f"sessions {run.get('sessions', 'open')}, "
            f"{run['wall_s']:.0f} s on {run['jobs']} process(es).",
            "",
            "## Summary",
            "",
            "TTFT p90 / best = a policy's p90 over the lowest p90 of any policy in the same "
            "cell; geomean over cells.",
            "",
            summary_table(doc["summary"]),
            "",
            "## Cells",
            "",
            cell_table(doc["cells"]),
            "",
        ]
    )
