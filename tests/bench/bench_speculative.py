"""What speculative entries cost per request, in process.

    python tests/bench/bench_speculative.py [--blocks 128] [--pods 4]

CPU microseconds (``time.process_time``) per call of the operations a request or an
event pays, on a chain of ``--blocks`` keys (128 = a 2,048-token prompt at block size
16) with ``--pods`` candidates:

* ``lookup, empty``  -- ``RouteLearner.extend`` when no pod has entries (the common case:
  every pod publishes its events);
* ``write new``      -- a learning pod is sent a chain it holds no entry for;
* ``write refresh``  -- ... a chain it already holds (every entry re-armed);
* ``write nothing``  -- ... a chain the index already shows whole;
* ``lookup``         -- ``extend`` with one pod holding the chain speculatively;
* ``confirm``        -- a ``BlockStored`` of the whole chain confirms its entries.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from router.config import SpeculativeSettings
from router.decision.learning import RouteLearner


def per_call(fn: Callable[[int], object], n: int) -> float:
    """CPU us per ``fn(i)`` for i in 0..n-1, after a warm-up on n..n+199."""
    for i in range(n, n + 200):
        fn(i)
    t0 = time.process_time()
    for i in range(n):
        fn(i)
    return 1e6 * (time.process_time() - t0) / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=128)
    ap.add_argument("--pods", type=int, default=4)
    ap.add_argument("--n", type=int, default=20_000)
    args = ap.parse_args()
    rng = random.Random(3)
    pods = [f"sim-{i}" for i in range(args.pods)]
    chains = [[rng.getrandbits(64) for _ in range(args.blocks)] for _ in range(args.n + 200)]
    chain = chains[0]
    settings = SpeculativeSettings()  # max_entries 250,000: writes past it evict
    lr = RouteLearner(settings, events_off=True)
    idx = lr.index
    rows: list[tuple[str, float]] = []
    rows.append(("lookup, empty", per_call(lambda i: lr.extend(chain, pods, {}), args.n)))
    rows.append(("write new", per_call(lambda i: idx.add(pods[0], chains[i], 120.0), args.n)))
    fresh = RouteLearner(settings, events_off=True).index
    fresh.add(pods[0], chain, 120.0)
    rows.append(("write refresh", per_call(lambda i: fresh.add(pods[0], chain, 120.0), args.n)))
    whole = args.blocks
    rows.append(
        ("write nothing", per_call(lambda i: fresh.add(pods[1], chain, 120.0, whole), args.n))
    )
    one = RouteLearner(settings, events_off=True)
    one.index.add(pods[0], chain, 120.0)
    rows.append(("lookup", per_call(lambda i: one.extend(chain, pods, {}), args.n)))
    conf = RouteLearner(settings, events_off=True).index
    for c in chains[: args.n]:
        conf.add(pods[0], c, 120.0)
    rows.append(("confirm", per_call(lambda i: conf.confirm(pods[0], chains[i]), args.n)))
    print(f"| operation ({args.blocks} blocks, {args.pods} pods) | CPU us / call |\n|---|---:|")
    for name, us in rows:
        print(f"| {name} | {us:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
