"""Prints, as one JSON object, what tests/deploy/test_compiled_build.py compares between
a compiled build and the sources: the build kind, a replay of ``cost`` on both pod
models (every request's TTFT, pod and hits), a speculative index's answers and a block
hasher's keys.  Run with PYTHONPATH set to the build under test."""

from __future__ import annotations

import json
import sys

from scoring.blocks import BlockHasher
from scoring.compiled import build_kind
from scoring.index.speculative import SpeculativeIndex
from scoring.policies import build_policy
from scoring.replay.engine import replay_policy
from scoring.replay.fleet_args import fleet_defaults
from scoring.replay.matrix import Cell, fleet_for, load_workload, pod_fleet
from scoring.replay.offered_load import scale_to_load


def replays() -> dict[str, object]:
    out: dict[str, object] = {}
    for workload, caches in (("chat", "unequal"), ("agentic", "mixed")):
        cell = Cell(workload, 4, caches, "small", 1.1)
        trace = load_workload(workload, 3, limit=300, block_size=16, traces_dir="")
        for pod_model in ("simpod", "vllm"):
            cfg = pod_fleet(fleet_for(cell, trace), pod_model)
            scaled, _ = scale_to_load(trace, cfg, cell.load)
            run = replay_policy(scaled, build_policy("cost", fleet_defaults("cost", cfg)), cfg)
            out[f"{workload}/{pod_model}"] = [run.ttft_s, run.pod_of, run.hit_tokens]
    return out


def speculative() -> list[object]:
    now = [0.0]
    index = SpeculativeIndex(max_entries=50, clock=lambda: now[0])
    answers: list[object] = []
    for step in range(40):
        now[0] = step * 0.5
        keys = [(step % 7) * 100 + i for i in range(step % 5 + 3)]
        answers.append(index.add(f"pod-{step % 3}", keys, ttl_s=4.0 if step % 2 else 9.0))
        answers.append(index.lookup(keys, ["pod-0", "pod-1", "pod-2"], {"pod-1": 1}))
        if step % 6 == 5:
            answers.append(index.drop(f"pod-{step % 3}", keys[1:]))
    answers.append(index.stats.as_dict())
    return answers


def main() -> int:
    hasher = BlockHasher(16, model="m")
    tokens = list(range(1000))
    print(
        json.dumps(
            {
                "build": build_kind(),
                "replays": replays(),
                "speculative": speculative(),
                "keys": [hasher.keys(tokens), hasher.keys(tokens, lora="a", cache_salt="s")],
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
