"""Pod-model benchmark: the same replay with ``--pod-model simple`` and ``--pod-model vllm``.

    python tests/bench/bench_pod_models.py [--limit 3000] [--pods 8]
                                           [--capacity-tokens 1000000]
                                           [--preset llama3-8b-h100] [--repeat 3]

Runs ``kvroute replay ../shared/traces/mooncake_conversation.jsonl --pods 8
--capacity-tokens 1000000 --limit 3000 --pod-model M`` (all policies, every other
setting at its default) for both models, ``--repeat`` times, and prints per model the
policy table (hit rate, of pooled ceiling, TTFT p50/p90/p99, imbalance; vllm: preemptions
and engine steps) and the wall time: the whole run (median and max, ceilings included)
and the median replay loop per policy.  Last, it times ``cost`` on the vllm model
stepping over decode runs (the default) and one step at a time: same results, the
speed-up of stepping analytically.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from scoring.policies import build_policy
from scoring.replay.cli import build_parser, run
from scoring.replay.engine import replay_policy
from scoring.replay.fleet_args import fleet_config, fleet_defaults
from scoring.replay.trace import load_trace
from scoring.replay.vllm_pod import VllmFleetConfig
from scoring.replay.workload import percentile

TRACE = Path(__file__).resolve().parents[2] / ".." / "shared" / "traces"


def replay(trace: Path, extra: list[str]) -> tuple[dict[str, Any], float]:
    args = build_parser().parse_args([str(trace), "--no-progress", *extra])
    t0 = time.perf_counter()
    result = run(args)
    return result, time.perf_counter() - t0


def table(result: dict[str, Any], loop_walls: dict[str, list[float]]) -> str:
    pooled = result["ceilings"]["pooled"]
    vllm = result["fleet"].get("pod_model") == "vllm"
    head = "| policy | hit rate | of pooled | TTFT p50 (s) | p90 (s) | p99 (s) | imbalance |"
    head += " preemptions | engine steps |" if vllm else ""
    head += " replay loop (s) |"
    lines = [head, "|---|" + "---:|" * (head.count("|") - 2)]
    for name, m in result["policies"].items():
        row = (
            f"| {name} | {m['hit_rate']:.1%} | {m['hit_rate'] / pooled:.1%} "
            f"| {m['ttft_p50_s']:.2f} | {m['ttft_p90_s']:.2f} | {m['ttft_p99_s']:.2f} "
            f"| {m['imbalance']:.2f} |"
        )
        if vllm:
            row += f" {m['preemptions']:,} | {m['engine_steps']:,} |"
        row += f" {statistics.median(loop_walls[name]):.2f} |"
        lines.append(row)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=(TRACE / "mooncake_conversation.jsonl").resolve())
    ap.add_argument("--pods", default="8")
    ap.add_argument("--capacity-tokens", default="1000000")
    ap.add_argument("--limit", default="3000")
    ap.add_argument("--preset", default="llama3-8b-h100")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args(argv)
    base = ["--pods", a.pods, "--capacity-tokens", a.capacity_tokens, "--limit", a.limit]
    for model in ("simple", "vllm"):
        extra = [*base, "--pod-model", model]
        if model == "vllm":
            extra += ["--preset", a.preset]
        walls: list[float] = []
        loops: dict[str, list[float]] = {}
        result: dict[str, Any] = {}
        for _ in range(a.repeat):
            result, wall = replay(a.trace, extra)
            walls.append(wall)
            for name, m in result["policies"].items():
                loops.setdefault(name, []).append(m["replay_wall_s"])
        print(f"`kvroute replay {a.trace.name} {' '.join(extra)}`: ", end="")
        print(f"whole run median {statistics.median(walls):.2f} s, max {max(walls):.2f} s")
        print(f"({a.repeat} runs; pooled ceiling {result['ceilings']['pooled']:.1%})\n")
        print(table(result, loops) + "\n", flush=True)
    vllm = [*base, "--pod-model", "vllm", "--preset", a.preset]
    args = build_parser().parse_args([str(a.trace), *vllm])
    trace = load_trace(a.trace)
    trace.requests = trace.requests[: int(a.limit)]
    cfg = fleet_config(args, trace.block_size)
    assert isinstance(cfg, VllmFleetConfig)
    print("| cost, vllm pods | wall (s) | engine steps | TTFT p90 (s) |")
    print("|---|---:|---:|---:|")
    for ff in (True, False):
        run_cfg = dataclasses.replace(cfg, fast_forward=ff)
        out = replay_policy(trace, build_policy("cost", fleet_defaults("cost", run_cfg)), run_cfg)
        p90 = percentile(out.ttft_s, 90)
        mode = "stepping over decode runs" if ff else "one step at a time"
        print(f"| {mode} | {out.wall_s:.2f} | {out.engine_steps:,} | {p90:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
