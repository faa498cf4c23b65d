"""Where one matrix cell's slow requests come from: its TTFT and hit rate per time
window, and per pod over a stretch of the trace, for several policies side by side.

    python tests/bench/bench_cell_anatomy.py --cell rag_bursty/p8-equal/medium/load80 \\
        --seed 107 --policy cost --policy precise_prefix --pods-from 40 --pods-to 120

The matrix (``bench_quality_matrix.py``) says *that* a policy's p90 lost in a cell; this
says *when* and *where*.  It replays the cell as the matrix does (same trace, fleet and
load; vLLM pod model unless ``--pod-model simpod``; block size 16 as the matrix's default)
and prints:

* per ``--window`` seconds of arrivals: requests, then per policy the window's TTFT p90,
  its hit rate and the pods it used;
* per pod over the whole run: its speed and cache, requests, prompt and computed
  tokens, busy seconds, preemptions (vLLM pod model) and TTFT p50 / p90;
* TTFT by prompt size (the trace's quartiles), per group of pods of one speed;
* per pod, for arrivals between ``--pods-from`` and ``--pods-to`` seconds (default: the
  window with the largest spread of p90 between the policies): requests, mean prompt,
  hit rate, median and largest TTFT.

A policy that piles a burst onto the pods holding a shared prefix shows as one pod with
many requests, a high hit rate and a TTFT median many times the others'.  Session 27 found
the learned ``cost``'s rag_bursty miss that way (docs/history/quality_matrix.md, "Session 27").
Replay time is virtual: the numbers do not depend on the machine.  About 10-60 s a policy.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from scoring.policies.registry import available_policies, build_policy
from scoring.replay.engine import PolicyRun, replay_policy
from scoring.replay.fleet_args import fleet_defaults
from scoring.replay.matrix import (
    MATRIX_SESSIONS,
    POD_MODELS,
    VLLM_PRESET,
    cell_replay_input,
    full_matrix,
    matrix_presets,
    parse_variant,
    quick_matrix,
)
from scoring.replay.session_loop import SESSION_MODES
from scoring.replay.simpod import PerPod, ReplayConfigError


def quantile(xs: Sequence[float], q: float) -> float:
    """The ``q`` quantile of the answered requests' TTFT (a refused request's is NaN)."""
    s = sorted(x for x in xs if x == x)
    return s[min(len(s) - 1, int(len(s) * q))] if s else float("nan")


def p90(xs: Sequence[float]) -> float:
    return quantile(xs, 0.9)


def hit_rate(run: PolicyRun, idx: Sequence[int]) -> float:
    prompt = sum(run.prompt_tokens[i] for i in idx)
    return sum(run.hit_tokens[i] for i in idx) / prompt if prompt else 0.0


def windows(arrivals: Sequence[float], width: float) -> list[tuple[float, list[int]]]:
    """``(start, request indices)`` per ``width`` seconds of arrivals, empty ones left out."""
    t0 = arrivals[0] if arrivals else 0.0
    out: dict[int, list[int]] = defaultdict(list)
    for i, a in enumerate(arrivals):
        out[int((a - t0) // width)].append(i)
    return [(k * width, out[k]) for k in sorted(out)]


def whole_run_by_pod(runs: dict[str, PolicyRun], cfg: PerPod) -> None:
    """Per pod over the whole run: its speed and cache, the requests and prompt tokens
    sent there, those it computed (not hit), its busy seconds, its preemptions and TTFT.
    Two policies that give the pods the same work (computed tokens, busy seconds) and
    different TTFT differ in *which* requests they sent where."""
    speeds = [cfg.speed(i) for i in range(cfg.pods)]
    caps = [cfg.pod_capacity(i) for i in range(cfg.pods)]
    for label, run in runs.items():
        print()
        print(f"Whole run per pod, `{label}`:")
        print()
        print(
            "| pod | speed | cache (tokens) | requests | prompt tokens | computed tokens "
            "| busy (s) | preemptions | TTFT p50 / p90 (s) |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        by_pod: dict[int, list[int]] = defaultdict(list)
        for i, pod in enumerate(run.pod_of):
            by_pod[pod].append(i)
        for pod in range(len(run.pods)):
            mine = by_pod.get(pod, [])
            prompt = sum(run.prompt_tokens[i] for i in mine)
            computed = prompt - sum(run.hit_tokens[i] for i in mine)
            ttft = [run.ttft_s[i] for i in mine]
            pre = run.pod_preemptions[pod] if run.pod_preemptions else 0
            print(
                f"| {run.pods[pod]} | {speeds[pod]:.2f} | {caps[pod]:,} | {len(mine)} "
                f"| {prompt:,} | {computed:,} | {run.busy_s[pod]:.0f} | {pre} "
                f"| {quantile(ttft, 0.5):.2f} / {quantile(ttft, 0.9):.2f} |"
            )


def by_prompt_size(runs: dict[str, PolicyRun], cfg: PerPod) -> None:
    """TTFT by the prompt's size quartile (the trace's own quartiles), per group of
    pods of one speed: a policy that sends long prompts to one kind of pod and short
    ones to another shows here, with what it cost each size."""
    speeds = [cfg.speed(i) for i in range(cfg.pods)]
    groups = sorted(set(speeds), reverse=True)
    first = next(iter(runs.values()))
    prompts = first.prompt_tokens
    edges = [quantile([float(p) for p in prompts], q) for q in (0.25, 0.5, 0.75)]
    bounds = [0.0, *edges, float("inf")]
    for label, run in runs.items():
        tail = quantile(run.ttft_s, 0.9)
        print()
        print(f"TTFT by prompt size, `{label}` (p90 of the run {tail:.2f} s):")
        print()
        heads = " | ".join(
            f"speed {g:.2f}: requests / p50 / p90 / in the run's tail" for g in groups
        )
        print(f"| prompt tokens | {heads} |")
        print("|---|" + "---:|" * len(groups))
        for lo, hi in itertools.pairwise(bounds):
            cols = []
            for g in groups:
                idx = [
                    i for i, p in enumerate(prompts) if lo <= p < hi and speeds[run.pod_of[i]] == g
                ]
                t = [run.ttft_s[i] for i in idx]
                over = sum(1 for x in t if x > tail)
                cols.append(
                    f"{len(idx)} / {quantile(t, 0.5):.2f} / {quantile(t, 0.9):.2f} / {over}"
                )
            top = "" if hi == float("inf") else f"{hi:,.0f}"
            print(f"| {lo:,.0f}-{top} | " + " | ".join(cols) + " |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--cell", required=True, help="a matrix cell id, e.g. rag/p8-equal/medium/load80"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policy", action="append", default=[], choices=available_policies())
    ap.add_argument("--variant", action="append", default=[], metavar="LABEL=POLICY:K=V,...")
    ap.add_argument("--pod-model", default="vllm", choices=POD_MODELS)
    ap.add_argument("--preset", default=VLLM_PRESET, choices=matrix_presets())
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--limit", type=int, default=None, help="the first N requests only")
    ap.add_argument("--window", type=float, default=20.0, help="seconds of arrivals a row")
    ap.add_argument("--pods-from", type=float, default=None, metavar="S")
    ap.add_argument("--pods-to", type=float, default=None, metavar="S")
    ap.add_argument(
        "--sessions",
        choices=SESSION_MODES,
        default=MATRIX_SESSIONS,
        help="closed (the matrix's default): a session's next turn after its previous "
        "answer (rows stay by planned arrival); open: every request at its planned time",
    )
    a = ap.parse_args(argv)
    # the matrix's cells on any fleet size it takes (held-out sizes too: --fleet-sizes)
    cells = {c.id: c for c in (*full_matrix(range(2, 65)), *quick_matrix())}
    cell = cells.get(a.cell)
    if cell is None:
        print(f"bench_cell_anatomy: no matrix cell {a.cell!r}", file=sys.stderr)
        return 2
    if not a.window > 0:
        print("bench_cell_anatomy: --window must be > 0", file=sys.stderr)
        return 2
    runs_of: list[tuple[str, str, dict[str, Any]]] = [(p, p, {}) for p in a.policy]
    try:
        runs_of += [parse_variant(v) for v in a.variant]
    except ReplayConfigError as exc:
        print(f"bench_cell_anatomy: {exc}", file=sys.stderr)
        return 2
    if not runs_of:
        runs_of = [(p, p, {}) for p in ("cost", "precise_prefix", "llmd")]
    scaled, cfg, _ = cell_replay_input(
        cell, a.seed, limit=a.limit, block_size=a.block_size, pod_model=a.pod_model, preset=a.preset
    )
    arrivals = [r.arrival_s for r in scaled.requests]
    runs = {
        label: replay_policy(
            scaled,
            build_policy(policy, {**fleet_defaults(policy, cfg), **params}),
            cfg,
            sessions=a.sessions,
        )
        for label, policy, params in runs_of
    }
    engine = f" ({a.preset})" if a.pod_model == "vllm" else ""
    print(
        f"{cell.id} seed {a.seed}, {len(arrivals)} requests, pod model {a.pod_model}{engine}, "
        f"sessions {a.sessions}"
    )
    for label, run in runs.items():
        print(
            f"  {label}: TTFT p90 {p90(run.ttft_s):.2f} s, hit rate "
            f"{hit_rate(run, range(len(arrivals))):.3f}, preemptions {run.preemptions}"
        )
    print()
    print("| from (s) | requests | " + " | ".join(f"{x} p90 / hit / pods" for x in runs) + " |")
    print("|---:|---:|" + "---:|" * len(runs))
    spread: list[tuple[float, float]] = []
    for start, idx in windows(arrivals, a.window):
        cols = []
        p90s = []
        for run in runs.values():
            q = p90([run.ttft_s[i] for i in idx])
            p90s.append(q)
            cols.append(f"{q:.1f} / {hit_rate(run, idx):.2f} / {len({run.pod_of[i] for i in idx})}")
        spread.append((max(p90s) / max(min(p90s), 1e-9), start))
        print(f"| {start:.0f} | {len(idx)} | " + " | ".join(cols) + " |")
    whole_run_by_pod(runs, cfg)
    by_prompt_size(runs, cfg)
    lo = a.pods_from if a.pods_from is not None else max(spread)[1]
    hi = a.pods_to if a.pods_to is not None else lo + a.window
    t0 = arrivals[0] if arrivals else 0.0
    idx = [i for i, x in enumerate(arrivals) if lo <= x - t0 < hi]
    print()
    print(f"Per pod, arrivals {lo:.0f}-{hi:.0f} s ({len(idx)} requests)")
    for label, run in runs.items():
        print()
        print(f"`{label}`:")
        print()
        print("| pod | requests | mean prompt | hit rate | TTFT median / max (s) |")
        print("|---|---:|---:|---:|---:|")
        by_pod: dict[int, list[int]] = defaultdict(list)
        for i in idx:
            by_pod[run.pod_of[i]].append(i)
        for pod in sorted(by_pod):
            mine = by_pod[pod]
            ttft = sorted(x for x in (run.ttft_s[i] for i in mine) if x == x) or [float("nan")]
            prompt = sum(run.prompt_tokens[i] for i in mine) / len(mine)
            print(
                f"| {run.pods[pod]} | {len(mine)} | {prompt:.0f} | {hit_rate(run, mine):.2f} "
                f"| {ttft[len(ttft) // 2]:.1f} / {ttft[-1]:.1f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
