"""A policy's own bookkeeping per request, by prompt length, in process.

    python tests/bench/bench_policy_bookkeeping.py [--policy cost] [--tokens 64,2048,200000]
        [--requests 30] [--root DIR]

Times ``pick`` + ``on_routed`` + ``on_complete`` of one policy object on 4 pod views
(capacity 20,000 blocks, empty index), for distinct prompts of each length (block size
16), and prints the median microseconds per request.  ``--root DIR`` imports the policies
from another checkout (e.g. a ``git archive`` of an older main), for a before/after in one
sitting.  No pods, no sockets: what the policy's in-flight prefixes, hot set and ledger
cost as the prompt grows.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", default="cost")
    ap.add_argument("--tokens", default="64,2048,200000")
    ap.add_argument("--requests", type=int, default=30)
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[2])
    a = ap.parse_args()
    sys.path.insert(0, str(a.root.resolve()))
    from scoring.blocks import BlockHasher
    from scoring.policies import build_policy
    from scoring.policies.base import PodView, RouteRequest

    hasher = BlockHasher(16, "m")
    pods = [PodView(pod=f"p{i}", capacity_blocks=20_000, resident_blocks=0) for i in range(4)]
    print(f"{a.policy} from {a.root}: median us per pick + routed + complete")
    for n in (int(t) for t in a.tokens.split(",")):
        policy = build_policy(a.policy)
        took = []
        for r in range(a.requests):
            keys = hasher.keys([(r * 7 + i) % 50_000 for i in range(n)])
            req = RouteRequest(f"r{r}", "m", n, keys, 16, None, None, None)
            t0 = time.perf_counter()
            pod = policy.pick(req, pods).pod
            policy.on_routed(req, pod)
            policy.on_complete(req, pod)
            took.append(time.perf_counter() - t0)
        print(f"{n:>8} tokens  {statistics.median(took) * 1e6:10.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
