"""Loop lag of the router while its KV-event writer catches up on thousands of batches.

    python tests/bench/bench_event_catchup.py [--pods 3] [--history 20000] [--burst 8000]
        [--memory] [--find-holds]

The soak (bench_soak.py) once lost every pod to health-check timeouts while the event
writer caught up after a fault: the catch-up held the loop the health checks, the
proxy and the client share.  This measures that loop directly.

Real parts: a valkey-server (the soak's shared index; ``--memory`` for the in-memory
one), the router app (``create_app``: the same sink, speculative entries and Redis
guard as ``kvroute serve --redis-url ... --index-writer``) served on 127.0.0.1, and a
*publisher process* speaking vLLM's wire format for ``--pods`` pods: a PUB socket and
a replay ROUTER holding the last 10,000 batches each (vLLM's ``buffer_steps``; replies
sent without waiting, as vLLM's ``_service_replay`` does).

Two forced catch-ups per pod, in turn:

* **join**: each pod has published ``--history`` batches before the router starts, so
  its first live batch triggers a join replay whose buffer no longer reaches back to
  seq 0: a resync, then 10,000 replayed batches re-learned;
* **burst**: each pod then publishes ``--burst`` batches as fast as it can, more than
  ``events.queue_size`` (2,000): the queue overflows, the pod is resynced and its gap
  replayed.

Each batch is one ``BlockStored`` of 4 blocks of 16 tokens and a ``BlockRemoved`` of
the pod's blocks older than 8,000 (a bounded cache, like an engine's).  A probe task
sleeps 10 ms in a loop and records how late it wakes (the loop lag a health check or a
request would see); an HTTP client in this loop asks the router's ``/health`` every
100 ms with a 1 s timeout (the soak's health timeout).  Printed: catch-up time, probe
lag p50 / p99 / max, the /health round trips p99 / max and how many took over 1 s,
and the longest single loop step in CPU time per task (a step is the code between two
awaits: what holds the loop, whatever else the machine runs).
``--find-holds`` starts a watchdog thread that, whenever the probe is more than 100 ms
late, samples the loop thread's stack and prints the most frequent places the loop was
held (where to look when max is large).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import multiprocessing as mp
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.bench.loopwatch import LoopWatch, top_steps
from tests.support.redis_server import running_server

BS = 16
BLOCKS = 4
WINDOW = 8_000  # blocks a pod holds (older ones are removed)
BUFFER = 10_000  # vLLM's replay buffer_steps
MODEL = "m"


def publisher(pods: int, history: int, burst: int, conn: Any) -> None:
    """Child process: ``pods`` PUB + replay ROUTER pairs; commands through ``conn``."""
    from collections import deque

    import msgspec
    import zmq

    ctx = zmq.Context()
    enc = msgspec.msgpack.Encoder()
    pubs, routers, seqs, eps = [], [], [], []
    buffers: list[deque[tuple[int, bytes]]] = []
    for _ in range(pods):
        pub = ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, 100_000)
        pub.bind("tcp://127.0.0.1:*")
        rt = ctx.socket(zmq.ROUTER)
        rt.bind("tcp://127.0.0.1:*")
        pubs.append(pub)
        routers.append(rt)
        buffers.append(deque(maxlen=BUFFER))
        seqs.append(0)
        eps.append(
            (
                pub.getsockopt_string(zmq.LAST_ENDPOINT),
                rt.getsockopt_string(zmq.LAST_ENDPOINT),
            )
        )
    topics = [f"kv@pod-{i}@{MODEL}".encode() for i in range(pods)]

    def batch(i: int) -> None:
        seq = seqs[i]
        first = seq * BLOCKS + 1
        events: list[dict[str, Any]] = [
            {
                "type": "BlockStored",
                "block_hashes": list(range(first, first + BLOCKS)),
                "parent_block_hash": None,
                "token_ids": [(seq * 7 + j) % 50_000 for j in range(BLOCKS * BS)],
                "block_size": BS,
                "medium": "GPU",
            }
        ]
        old = first - WINDOW
        if old > 0:
            events.append({"type": "BlockRemoved", "block_hashes": list(range(old, old + BLOCKS))})
        body = enc.encode([time.time(), events, 0])
        buffers[i].append((seq, body))
        pubs[i].send_multipart([topics[i], seq.to_bytes(8, "big"), body])
        seqs[i] = seq + 1

    def serve_replays() -> None:
        for i, rt in enumerate(routers):
            while True:
                try:
                    ident, _, start = rt.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                want = int.from_bytes(start, "big")
                for seq, body in list(buffers[i]):
                    if seq >= want:  # a ROUTER drops what its pipe cannot hold, as vLLM's
                        rt.send_multipart([ident, b"", seq.to_bytes(8, "big"), body])
                rt.send_multipart([ident, b"", (-1).to_bytes(8, "big", signed=True), b""])

    for _ in range(history):
        for i in range(pods):
            batch(i)
    conn.send(eps)
    rate_end = 0.0
    phase = "idle"
    while True:
        if conn.poll(0):
            phase = conn.recv()
            if phase == "stop":
                break
            if phase == "burst":
                for _ in range(burst):
                    for i in range(pods):
                        batch(i)
                conn.send("burst sent")
                phase = "live"
        serve_replays()
        if phase == "live" and time.perf_counter() >= rate_end:
            for i in range(pods):  # 50 batches/s per pod: a steady request load
                batch(i)
            rate_end = time.perf_counter() + 0.02
        time.sleep(0.001)
    for s in (*pubs, *routers):
        s.close(linger=0)
    ctx.term()


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


class Watchdog:
    """A thread sampling the loop thread's stack while the probe is > 100 ms late."""

    def __init__(self, watch: LoopWatch) -> None:
        self.watch = watch
        self.loop_thread = threading.get_ident()
        self.samples: collections.Counter[str] = collections.Counter()
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        while True:
            time.sleep(0.02)
            beat = self.watch.beat
            if not beat or time.perf_counter() - beat < 0.1:
                continue
            frame = sys._current_frames().get(self.loop_thread)
            ours = []
            top = (
                f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} {frame.f_code.co_name}"
                if frame is not None
                else "?"
            )
            while frame is not None:
                code = frame.f_code
                if "/router/" in code.co_filename or "/scoring/" in code.co_filename:
                    ours.append(f"{Path(code.co_filename).name}:{frame.f_lineno} {code.co_name}")
                frame = frame.f_back
            self.samples[" <- ".join(ours[:4]) or f"(outside router/scoring: {top})"] += 1

    def report(self) -> None:
        print("loop held > 100 ms, 20 ms samples (innermost first):")
        for where, n in self.samples.most_common(12):
            print(f"  {n:5d}  {where}")


WATCH = LoopWatch()


async def health_checks(url: str, stop: asyncio.Event, took: list[float]) -> None:
    """GET /health every 100 ms with a 1 s timeout (a failure counts as >= 1 s)."""
    async with httpx.AsyncClient(timeout=1.0) as c:
        while not stop.is_set():
            t = time.perf_counter()
            try:
                (await c.get(url + "/health")).raise_for_status()
                took.append(time.perf_counter() - t)
            except httpx.HTTPError:
                took.append(max(1.0, time.perf_counter() - t))
            await asyncio.sleep(0.1)


async def wait_caught_up(core: Any, pods: int, seq_floor: int, timeout: float) -> float:
    """Seconds until every pod's last applied seq reaches ``seq_floor`` and the writer
    is idle with no queue."""
    t0 = time.perf_counter()
    sub = core.subscriber
    while time.perf_counter() - t0 < timeout:
        st = sub.stats.pods
        if all(
            (p := st.get(f"pod-{i}")) is not None and p.last_seq >= seq_floor for i in range(pods)
        ) and not any(p.queued for p in st.values()):
            return time.perf_counter() - t0
        await asyncio.sleep(0.05)
    raise TimeoutError(f"not caught up after {timeout} s")


async def phase(
    name: str, core: Any, url: str, pods: int, seq_floor: int, start: Any
) -> dict[str, float]:
    stop = asyncio.Event()
    health: list[float] = []
    tasks = [
        asyncio.create_task(WATCH.probe(stop)),
        asyncio.create_task(health_checks(url, stop, health)),
    ]
    await asyncio.sleep(0.2)
    WATCH.take()
    WATCH.on = True
    await start()
    took = await wait_caught_up(core, pods, seq_floor, 300)
    WATCH.on = False
    stop.set()
    await asyncio.gather(*tasks)
    where = dict(WATCH.where)
    WATCH.where.clear()
    lag, steps = WATCH.take()
    row = {
        "catch_up_s": took,
        "lag_p50_ms": 1000 * statistics.median(lag),
        "lag_p99_ms": 1000 * pct(lag, 0.99),
        "lag_max_ms": 1000 * max(lag),
        "health_p99_ms": 1000 * pct(health, 0.99),
        "health_max_ms": 1000 * max(health),
        "health_over_1s": float(sum(1 for x in health if x >= 1.0)),
    }
    print(
        f"| {name} | {took:.1f} | {row['lag_p50_ms']:.1f} | {row['lag_p99_ms']:.1f} | "
        f"{row['lag_max_ms']:.0f} | {row['health_p99_ms']:.0f} | {row['health_max_ms']:.0f} "
        f"| {row['health_over_1s']:.0f} | {top_steps(steps)} |",
        flush=True,
    )
    print(f"  (longest garbage collection: {1000 * WATCH.take_gc():.0f} ms CPU)")
    for task, at in where.items():
        print(f"  ({task}'s longest step ended at {at})")
    return row


async def main(args: argparse.Namespace) -> None:
    from router.config import Settings
    from router.proxy.app import create_app
    from router.proxy.serve import RunningServer

    holds = Watchdog(WATCH) if args.find_holds else None
    spawn = mp.get_context("spawn")
    parent, child = spawn.Pipe()
    proc = spawn.Process(target=publisher, args=(args.pods, args.history, args.burst, child))
    proc.start()
    try:
        eps = parent.recv()
        static = [
            {
                "name": f"pod-{i}",
                "url": "http://127.0.0.1:9",  # no HTTP: only its events matter here
                "events_endpoint": ev,
                "replay_endpoint": rp,
                "models": [MODEL],
            }
            for i, (ev, rp) in enumerate(eps)
        ]
        with running_server() as redis_url:
            cfg: dict[str, Any] = {
                "discovery": {"static": static},
                "fleet": {"enabled": False},
                "health": {"enabled": False},
                "log_level": "warning",
                "block_size": BS,
            }
            if not args.memory:
                cfg |= {"redis_url": redis_url, "index_writer": True}
            app = create_app(Settings.model_validate(cfg))
            async with RunningServer(app) as router:
                core = app.state.gateway
                print(f"{args.pods} pods, history {args.history}, burst {args.burst}, index "
                      f"{'memory' if args.memory else 'redis'}")  # fmt: skip
                print("| catch-up | s | lag p50 ms | lag p99 ms | lag max ms | /health p99 ms "
                      "| /health max ms | /health >= 1 s | longest step, CPU ms |")  # fmt: skip
                print("|---|---:|---:|---:|---:|---:|---:|---:|---|")

                async def live() -> None:
                    parent.send("live")

                await phase("join", core, router.url, args.pods, args.history, live)
                burst_done = asyncio.Event()

                async def burst() -> None:
                    parent.send("burst")
                    await asyncio.to_thread(parent.recv)
                    burst_done.set()

                await phase("burst", core, router.url, args.pods, args.history + args.burst, burst)
        if holds is not None:
            holds.report()
    finally:
        parent.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.kill()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pods", type=int, default=3)
    ap.add_argument("--history", type=int, default=20_000)
    ap.add_argument("--burst", type=int, default=8_000)
    ap.add_argument("--memory", action="store_true", help="the in-memory index, not Redis")
    ap.add_argument("--find-holds", action="store_true", help="asyncio debug: slow callbacks")
    asyncio.run(main(ap.parse_args()))
