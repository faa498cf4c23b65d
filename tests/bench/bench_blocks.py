"""Benchmark: token ids -> block key chain (scoring.blocks).

Run: python tests/bench/bench_blocks.py [--repeat N]
Prints a markdown table: per prompt size and block size, the median and p99 time per
prompt and the amortised time per block.  Target: <= 0.5 us per block (<= 1 ms for a
32K-token prompt at block size 16).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from scoring.blocks import BlockHasher


def measure(tokens: list[int], block_size: int, repeat: int) -> list[float]:
    hasher = BlockHasher(block_size, "bench-model")
    hasher.keys(tokens)  # warm up
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        hasher.keys(tokens)
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=200)
    args = ap.parse_args()
    rng = random.Random(7)
    print(
        "| prompt tokens | block size | blocks | median ms/prompt | p99 ms/prompt "
        "| us/block (median) |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for n in (1024, 8192, 32768, 131072):
        tokens = [rng.randrange(150_000) for _ in range(n)]
        for bs in (16, 32):
            repeat = max(20, args.repeat * 1024 // n)
            ts = sorted(measure(tokens, bs, repeat))
            med = statistics.median(ts)
            p99 = ts[min(len(ts) - 1, int(len(ts) * 0.99))]
            blocks = n // bs
            print(
                f"| {n:,} | {bs} | {blocks:,} | {med * 1e3:.3f} | {p99 * 1e3:.3f} "
                f"| {med / blocks * 1e6:.3f} |"
            )


if __name__ == "__main__":
    main()
