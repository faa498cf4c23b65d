"""Benchmark: the in-memory block index (scoring.index.memory) and KV-event ingest.

Run: python tests/bench/bench_index.py [--entries 1000000 10000000] [--lookups 2000]
(the Redis backend has its own: tests/bench/bench_redis_index.py).

Prints three markdown tables:

1. lookup latency of a 2,048-block chain -- wall-clock p50 / p99 / max, and the
   thread's CPU time p50 / p99 (what the lookup itself costs when a shared machine
   preempts the process; the wall p99 shows the preemption) -- with 16 / 64 / 256 pods
   and the given numbers of indexed (key, pod) entries; two query kinds:
   ``all-hit`` (every pod holds the whole chain: the walk never stops early, the worst
   case) and ``mixed`` (pods hold prefixes of random lengths of the queried chain);
2. ingest rate in block events per second through decode + apply + index write, for
   vLLM 0.32 payloads (map encoding): stores (BlockStored, 64 blocks per event),
   removals (BlockRemoved, one hash per event, as vLLM sends them), and the same with
   the engine-hash mode verifying every BlockStored;
3. memory per (block, pod) entry measured with tracemalloc (index alone, and the
   applier's per-pod engine-hash maps on top), for keys held by 1 pod and by 8 pods.

Targets (issue 2): lookup <= 200 us p99; ingest >= 100K block events/s per core;
<= 150 bytes per entry.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import statistics
import time
import tracemalloc

from scoring.events import (
    BlockRemoved,
    BlockStored,
    EngineHasher,
    IndexSink,
    KVEventApplier,
    encode_batch,
)
from scoring.index.memory import InMemoryIndex

CHAIN = 2048
BS = 16


def pct(ts: list[float], q: float) -> float:
    ts = sorted(ts)
    return ts[min(len(ts) - 1, int(len(ts) * q))]


# -- 1. lookups ----------------------------------------------------------------------


def build(pods: int, entries: int, rng: random.Random) -> tuple[InMemoryIndex, list[list[int]]]:
    """An index of ``entries`` (key, pod) pairs: 4 query chains of 2,048 blocks held by
    the pods (one by every pod, three as prefixes of random lengths), the rest random
    chains of 256 blocks each held by one or two pods."""
    idx = InMemoryIndex(max_entries=entries * 2)
    names = [f"pod-{i:03d}" for i in range(pods)]
    chains = [[rng.getrandbits(64) for _ in range(CHAIN)] for _ in range(4)]
    for p in names:  # the all-hit chain
        idx.add_sync(p, chains[0])
    for c in chains[1:]:  # mixed: random prefix lengths
        for p in names:
            n = rng.choice([0, 0, 16, 128, 512, 1024, 2048])
            if n:
                idx.add_sync(p, c[:n])
    filler = 256
    while len(idx) < entries:
        ks = [rng.getrandbits(64) for _ in range(filler)]
        idx.add_sync(names[rng.randrange(pods)], ks)
        if rng.random() < 0.5:
            idx.add_sync(names[rng.randrange(pods)], ks)
    return idx, chains


def bench_lookups(entry_counts: list[int], n_lookups: int) -> None:
    print("\n### Lookup of a 2,048-block chain (in-memory index)\n")
    print(
        "| entries | pods | query | wall p50 us | wall p99 us | wall max us "
        "| cpu p50 us | cpu p99 us | build s |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for entries in entry_counts:
        for pods in (16, 64, 256):
            rng = random.Random(pods)
            t0 = time.perf_counter()
            idx, chains = build(pods, entries, rng)
            build_s = time.perf_counter() - t0
            gc.collect()
            gc.freeze()  # what a long-running router does after start-up
            for kind, pool in (("all-hit", chains[:1]), ("mixed", chains[1:])):
                for c in pool:
                    idx.lookup_sync(c)  # warm
                ts: list[float] = []
                cpu: list[float] = []
                wall, thread = time.perf_counter, time.thread_time
                for i in range(n_lookups):
                    c = pool[i % len(pool)]
                    t, tc = wall(), thread()
                    idx.lookup_sync(c)
                    cpu.append(thread() - tc)
                    ts.append(wall() - t)
                print(
                    f"| {len(idx):,} | {pods} | {kind} | {statistics.median(ts) * 1e6:.0f} "
                    f"| {pct(ts, 0.99) * 1e6:.0f} | {max(ts) * 1e6:.0f} "
                    f"| {statistics.median(cpu) * 1e6:.0f} | {pct(cpu, 0.99) * 1e6:.0f} "
                    f"| {build_s:.1f} |"
                )
            gc.unfreeze()
            del idx, chains
            gc.collect()


# -- 2. ingest -----------------------------------------------------------------------


def make_payloads(
    pods: int, requests: int, rng: random.Random, hasher: EngineHasher | None
) -> tuple[list[tuple[str, bytes]], list[tuple[str, bytes]], int, int]:
    """Per request: one BlockStored of a 64-block chain (a 1,024-token prompt), and
    later one BlockRemoved per block, tail first, in batches of 32 events."""
    stores: list[tuple[str, bytes]] = []
    removes: list[tuple[str, bytes]] = []
    n_store = n_remove = 0
    for r in range(requests):
        pod = f"pod-{r % pods:03d}"
        tokens = [rng.randrange(150_000) for _ in range(64 * BS)]
        if hasher is not None:
            hashes: list[int | bytes] = [hasher.published(d) for d in hasher.chain(tokens, BS)]
        else:
            hashes = [rng.getrandbits(64) for _ in range(64)]
        stores.append(
            (pod, encode_batch([BlockStored(hashes, None, tokens, BS, None, "GPU")], float(r)))
        )
        n_store += 64
        rem = [BlockRemoved([h], "GPU") for h in reversed(hashes)]
        for i in range(0, len(rem), 32):
            removes.append((pod, encode_batch(rem[i : i + 32], float(r))))
        n_remove += 64
    return stores, removes, n_store, n_remove


def report(mode: str, label: str, n: int, t0: float, c0: float) -> None:
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    print(f"| {mode} | {label} | {n:,} | {dt:.2f} | {dc:.2f} | {n / dt:,.0f} | {n / dc:,.0f} |")


def bench_ingest() -> None:
    print("\n### Ingest: decode + apply + in-memory index write (one core)\n")
    print(
        "| mode | events | block events | wall s | cpu s | block events/s (wall) "
        "| block events/s per cpu-second |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    pods, requests = 16, 2000
    for mode in ("our keys", "engine-hash verify"):
        rng = random.Random(3)
        engine = EngineHasher("sha256", "bench") if mode != "our keys" else None
        stores, removes, n_store, n_remove = make_payloads(pods, requests, rng, engine)
        applier = KVEventApplier(engine_hasher=EngineHasher("sha256", "bench") if engine else None)
        for p in range(pods):
            applier.set_pod(f"pod-{p:03d}", "bench-model")
        index = InMemoryIndex()
        for label, payloads, n in (
            ("BlockStored x64 blocks", stores, n_store),
            ("BlockRemoved x1, 32/batch", removes, n_remove),
        ):
            t0, c0 = time.perf_counter(), time.process_time()
            for pod, payload in payloads:
                applier.ingest_sync(index, pod, payload)
            report(mode, label, n, t0, c0)
        assert len(index) == 0, "every stored block was removed again"
        if engine is None:  # the router's path: IndexSink, awaiting the async protocol
            sink = IndexSink(InMemoryIndex())

            async def run(sink: IndexSink, payloads: list[tuple[str, bytes]]) -> None:
                for pod, payload in payloads:
                    await sink.apply(pod, "bench-model", sink.decode(payload))

            for label, payloads, n in (
                ("BlockStored x64 blocks", stores, n_store),
                ("BlockRemoved x1, 32/batch", removes, n_remove),
            ):
                t0, c0 = time.perf_counter(), time.process_time()
                asyncio.run(run(sink, payloads))
                report("IndexSink (async)", label, n, t0, c0)
        s = applier.stats
        assert s.stored_blocks == n_store and s.removed_blocks == n_remove
        assert s.bad_events == s.decode_errors == s.unknown_removed == 0
        if engine is not None:
            h = applier.hasher
            assert h is not None and h.mismatches == 0 and h.matches == requests


# -- 3. memory -----------------------------------------------------------------------


def bench_memory() -> None:
    print("\n### Memory per (block, pod) entry (tracemalloc)\n")
    print("| what | pods | pods per key | entries | bytes/entry |")
    print("|---|---:|---:|---:|---:|")
    n = 200_000
    for pods, share in ((16, 1), (16, 8), (256, 1), (256, 8), (1000, 1), (1000, 8)):
        rng = random.Random(5)
        gc.collect()
        tracemalloc.start()
        idx = InMemoryIndex(max_entries=10 * n)
        keys = [rng.getrandbits(64) for _ in range(n // share)]
        for s in range(share):
            for p in range(pods):
                idx.add_sync(f"pod-{p}", keys[(p + s) % pods :: pods])
        del keys
        cur, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        print(f"| index | {pods} | {share} | {len(idx):,} | {cur / len(idx):.0f} |")
        del idx
    # index + applier (engine hash -> key, counts) fed by real payloads
    rng = random.Random(6)
    stores, _, _, _ = make_payloads(16, 2000, rng, None)
    gc.collect()
    tracemalloc.start()
    applier = KVEventApplier()
    for p in range(16):
        applier.set_pod(f"pod-{p:03d}", "bench-model")
    index = InMemoryIndex()
    for pod, payload in stores:
        applier.ingest_sync(index, pod, payload)
    cur, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"| index + applier maps | 16 | 1 | {len(index):,} | {cur / len(index):.0f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--entries", type=int, nargs="+", default=[1_000_000])
    ap.add_argument("--lookups", type=int, default=2000)
    ap.add_argument("--skip", nargs="*", default=[], choices=["lookup", "ingest", "memory"])
    args = ap.parse_args()
    if "lookup" not in args.skip:
        bench_lookups(args.entries, args.lookups)
    if "ingest" not in args.skip:
        bench_ingest()
    if "memory" not in args.skip:
        bench_memory()


if __name__ == "__main__":
    main()
