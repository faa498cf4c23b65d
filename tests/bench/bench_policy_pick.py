"""A policy's own decision cost, in process: ``pick`` plus the hooks the proxy calls.

    python tests/bench/bench_policy_pick.py [--policy cost] [--params '{"hot_window_s": 0}']
        [--pods 4] [--blocks 2] [--decisions 30000] [--repeat 5] [--tied]

Per decision: ``pick`` over ``--pods`` views, then ``on_routed``, ``on_first_token``,
``on_finished(None)`` and ``on_complete``, as ``bench_hot_path.py``'s ``decide`` loop
does after ``RequestRouter.decide`` (which adds parsing, tokenizing, hashing and the
index lookup).  The request is ``--blocks`` blocks long; by default the first pod holds
it (one pod wins), with ``--tied`` no pod does (every pick is a room tie-break).
Prints CPU microseconds per decision (``time.process_time``), each repeat and the
median: compare two checkouts side by side in one sitting (``cd DIR &&
PYTHONPATH=DIR python /path/to/this/bench_policy_pick.py``; a tree whose policy lacks
``on_first_token`` / ``on_finished`` runs without them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from scoring.policies import PodView, RouteRequest, build_policy
from scoring.policies.registry import available_policies


def run(
    policy_name: str, params: dict[str, object], pods: int, blocks: int, n: int, tied: bool
) -> float:
    policy = build_policy(policy_name, params)
    keys = list(range(1000, 1000 + blocks))
    views = [
        PodView(
            pod=f"pod-{i}",
            hits={"GPU": blocks} if i == 0 and not tied else {},
            running=0,
            kv_usage=0.0,
            resident_blocks=10,
            capacity_blocks=1000,
        )
        for i in range(pods)
    ]
    # an older tree's policy may lack the later hooks (run it with PYTHONPATH=DIR)
    first = getattr(policy, "on_first_token", None)
    finished = getattr(policy, "on_finished", None)
    t0 = time.process_time()
    for i in range(n):
        r = RouteRequest(
            request_id=f"r{i}",
            model="m",
            prompt_tokens=blocks * 16,
            block_keys=keys,
            block_size=16,
        )
        pod = policy.pick(r, views).pod
        policy.on_routed(r, pod)
        if first is not None:
            first(r, pod, 0.01)
        if finished is not None:
            finished(r, pod, None)
        policy.on_complete(r, pod)
    return 1e6 * (time.process_time() - t0) / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policy", default="cost", choices=available_policies())
    ap.add_argument("--params", default="{}", help="policy parameters, JSON")
    ap.add_argument("--pods", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=2, help="request length in blocks")
    ap.add_argument("--decisions", type=int, default=30_000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--tied", action="store_true", help="no pod holds the request")
    a = ap.parse_args()
    if a.pods < 1 or a.blocks < 1 or a.decisions < 1 or a.repeat < 1:
        print(
            "bench_policy_pick: --pods, --blocks, --decisions, --repeat must be >= 1",
            file=sys.stderr,
        )
        return 2
    params = json.loads(a.params)
    runs = [run(a.policy, params, a.pods, a.blocks, a.decisions, a.tied) for _ in range(a.repeat)]
    each = ", ".join(f"{x:.2f}" for x in runs)
    print(
        f"{a.policy} {params} pods={a.pods} blocks={a.blocks} tied={a.tied}: "
        f"CPU us / decision {each}; median {statistics.median(runs):.2f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
