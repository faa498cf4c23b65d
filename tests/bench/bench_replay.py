"""Replay benchmark: the README table for both Mooncake traces, and replay speed.

    python tests/bench/bench_replay.py [--repeat 3] [--capacity-tokens 1000000]
                                       [--prefill-rate 8000] [--pods 8]

For each trace it runs ``kvroute replay TRACE --pods 8 --capacity-tokens 1000000
--prefill-rate 8000`` (all policies) and prints a markdown table: hit rate, hit rate as a
fraction of the pooled-cache ceiling, TTFT p90 and p90 relative to round_robin,
imbalance.  Then it replays the conversation trace ``--repeat`` times per policy and
prints the median and max wall time per policy (target: < 60 s for 12,031 requests).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from scoring.replay.cli import build_parser, run

TRACES = Path(__file__).resolve().parents[2] / ".." / "shared" / "traces"


def replay(trace: Path, extra: list[str]) -> dict[str, Any]:
    args = build_parser().parse_args([str(trace), "--no-progress", *extra])
    return run(args)


def markdown(name: str, result: dict[str, Any]) -> str:
    c = result["ceilings"]
    rr = result["policies"]["round_robin"]["ttft_p90_s"]
    lines = [
        f"**{name}** — {result['workload']['requests']:,} requests; ceilings: infinite "
        f"{c['infinite']:.1%}, pooled {c['pooled']:.1%}",
        "",
        "| policy | hit rate | of pooled ceiling | TTFT p50 (s) | TTFT p90 (s) "
        "| p90 vs round_robin | imbalance (max/mean busy) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for pol, m in result["policies"].items():
        lines.append(
            f"| {pol} | {m['hit_rate']:.1%} | {m['hit_rate'] / c['pooled']:.1%} "
            f"| {m['ttft_p50_s']:.2f} | {m['ttft_p90_s']:.2f} | {m['ttft_p90_s'] / rr:.2f} "
            f"| {m['imbalance']:.2f} |"
        )
    return "\n".join(lines)


def chat_trace(path: Path, n_conv: int = 21, turns: int = 5) -> Path:
    """21 five-turn chats that share one ~900-token system prompt, 2 req/s (OpenAI bodies)."""
    system = {"role": "system", "content": "You are a helpful assistant. " * 30}
    convs: list[list[dict[str, str]]] = [[system] for _ in range(n_conv)]
    lines = []
    t = 0.0
    for turn in range(turns):
        for c in range(n_conv):
            ask = {"role": "user", "content": f"conv {c} turn {turn}: " + "tell me more. " * 40}
            convs[c] = [*convs[c], ask]
            t += 500.0
            body = {"messages": convs[c], "max_tokens": 64}
            lines.append(json.dumps({"timestamp": t, "session_id": f"c{c}", "body": body}))
            convs[c] = [*convs[c], {"role": "assistant", "content": f"answer {turn} " * 30}]
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--traces", type=Path, default=TRACES.resolve())
    ap.add_argument("--pods", default="8")
    ap.add_argument("--capacity-tokens", default="1000000")
    ap.add_argument("--prefill-rate", default="8000")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args(argv)
    fleet = [
        "--pods", a.pods, "--capacity-tokens", a.capacity_tokens, "--prefill-rate", a.prefill_rate
    ]  # fmt: skip
    print(f"fleet: {' '.join(fleet)} (other settings: kvroute replay defaults)\n")
    for name in ("mooncake_conversation", "mooncake_synthetic"):
        result = replay(a.traces / f"{name}.jsonl", fleet)
        print(markdown(name, result) + "\n", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        chats = chat_trace(Path(tmp) / "chats.jsonl")
        small = ["--format", "openai", "--tokenizer", "builtin", "--pods", "4"]
        small += ["--capacity-tokens", "20000", "--prefill-rate", "2000"]
        print(f"small fleet, shared system prompt: {' '.join(small)}\n")
        print(markdown("chats (21 conversations x 5 turns)", replay(chats, small)) + "\n")
    walls: dict[str, list[float]] = {}
    for _ in range(a.repeat):
        result = replay(a.traces / "mooncake_conversation.jsonl", fleet)
        for pol, m in result["policies"].items():
            walls.setdefault(pol, []).append(m["replay_wall_s"])
    print(f"replay wall time, mooncake_conversation (12,031 requests), {a.repeat} runs:\n")
    print("| policy | median (s) | max (s) | target |")
    print("|---|---:|---:|---|")
    worst = 0.0
    for pol, xs in walls.items():
        worst = max(worst, max(xs))
        print(f"| {pol} | {statistics.median(xs):.2f} | {max(xs):.2f} | < 60 s |")
    return 0 if worst < 60 else 1


if __name__ == "__main__":
    sys.exit(main())
