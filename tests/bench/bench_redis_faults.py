"""The Redis stores' request path through a Redis fault, against a real server.

    python tests/bench/bench_redis_faults.py [--fault kill|freeze|halfopen] [--down 5]
        [--workers 50] [--deadline 0.1]

Starts ``valkey-server`` (or ``redis-server`` from PATH) on a free 127.0.0.1 port and
runs ``--workers`` concurrent simulated requests, each doing what a routed request asks
of Redis: owner get, index lookup, load snapshot, ``begin``, a 10 ms "pod" wait,
``prefill_done``, ``end``, owner put -- on one shared ``RedisGuard`` (one pool, one
breaker, default settings but ``--deadline``).  A request that meets
``SharedStateUnavailable`` goes on without Redis (as the router will: local load, no
cache hits); only another exception is a failure.  After 1 s the fault starts and lasts
``--down`` seconds:

* ``kill``: SIGKILL, then a new empty server on the same port;
* ``freeze``: SIGSTOP, then SIGCONT (a hung server; its data survives);
* ``halfopen``: ``kill`` behind a relay that keeps the client's connections open and
  silent when the server goes, and accepts new ones that never answer while it is
  gone (a peer that vanished without FIN or RST: a lost node, a stale conntrack entry).

Prints the breaker's errors before the fault (a cold pool opening ``--workers``
connections at once on a busy machine can miss a few deadlines), then per second
(by the second the request started): requests done, requests that had to go without Redis, failed
requests, the slowest request; then how long after the end of the fault requests
were served by Redis again, and the load left in Redis once every request ended (it
must be 0: no leak).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from router.decision.owners import RedisOwnerStore
from scoring.index.breaker import SharedStateUnavailable
from scoring.index.redis import RedisIndex
from scoring.index.redis_guard import RedisGuard
from scoring.index.redis_load import RedisLoadStore
from tests.support.redis_server import FaultyServer

ROOT = Path(__file__).resolve().parents[2]
CHAIN = list(range(1, 65))


async def run(args: argparse.Namespace) -> None:
    with FaultyServer(tempfile.mkdtemp(prefix="kvroute-bench-faults-")) as server:
        relay = None
        port = server.port
        if args.fault == "halfopen":  # in a process of its own, as a network would be
            relay = subprocess.Popen(
                [sys.executable, "-m", "tests.support.tcp_relay", str(server.port)],
                stdout=subprocess.PIPE,
                cwd=ROOT,
            )
            assert relay.stdout is not None
            port = int(relay.stdout.readline())
        guard = RedisGuard.from_url(f"redis://127.0.0.1:{port}/0", request_deadline_s=args.deadline)
        index = RedisIndex(guard, namespace="bench")
        load = RedisLoadStore(guard, namespace="bench", replica="r0")
        owners = RedisOwnerStore(guard, "bench", 600, owns_client=False)
        await index.add("pod-0", CHAIN)
        t0 = time.monotonic()
        done: collections.Counter[int] = collections.Counter()
        degraded: collections.Counter[int] = collections.Counter()
        failed: collections.Counter[int] = collections.Counter()
        slowest: dict[int, float] = collections.defaultdict(float)
        last_degraded = [0.0]
        fault_end = [0.0]
        stop_at = 1.0 + args.down + args.after

        async def request(i: int, n: int) -> None:
            went_without = False
            pod = f"pod-{i % 4}"

            async def step(coro: object) -> object:
                nonlocal went_without
                try:
                    return await coro  # type: ignore[misc]
                except SharedStateUnavailable:
                    went_without = True
                    return None

            start = time.monotonic()
            try:
                await step(owners.get(f"r{i}-{n - 1}"))
                await step(index.lookup(CHAIN))
                await step(load.snapshot([f"pod-{k}" for k in range(4)]))
                await load.begin(pod, 640)  # never raises
                try:
                    await asyncio.sleep(0.01)
                    await load.prefill_done(pod, 640)
                finally:
                    await load.end(pod)
                await step(owners.put(f"r{i}-{n}", pod))
                sec = int(start - t0)
                (degraded if went_without else done)[sec] += 1
                if went_without:
                    last_degraded[0] = time.monotonic()
            except Exception as exc:  # a failure the router would turn into a 500
                failed[int(start - t0)] += 1
                print(f"failed: {type(exc).__name__}: {exc}")
            slowest[int(start - t0)] = max(slowest[int(start - t0)], time.monotonic() - start)

        async def worker(i: int) -> None:
            n = 0
            while time.monotonic() - t0 < stop_at:
                n += 1
                await request(i, n)

        async def fault() -> None:
            await asyncio.sleep(1.0)
            print(f"before the fault: breaker errors {dict(guard.breaker.errors)}")
            print(f"{time.monotonic() - t0:5.2f}s fault {args.fault} for {args.down:g}s")
            if args.fault == "freeze":
                server.freeze()
                await asyncio.sleep(args.down)
                server.thaw()
            else:  # kill, or halfopen: the same behind the relay
                server.kill()
                await asyncio.sleep(args.down)
                server.restart()
            fault_end[0] = time.monotonic()
            print(f"{time.monotonic() - t0:5.2f}s fault over")

        await asyncio.gather(fault(), *(worker(i) for i in range(args.workers)))
        print(f"{'s':>3} {'served':>7} {'no-redis':>8} {'failed':>6} {'slowest ms':>10}")
        for sec in range(int(stop_at) + 1):
            print(
                f"{sec:>3} {done[sec]:>7} {degraded[sec]:>8} {failed[sec]:>6} "
                f"{slowest[sec] * 1e3:>10.1f}"
            )
        back = max(0.0, last_degraded[0] - fault_end[0])
        print(f"last request without Redis: {back:.2f}s after the fault ended")
        await asyncio.sleep(0.2)  # the last writes land
        print(f"load left in Redis after every request ended: {await load.snapshot()}")
        kinds = dict(guard.breaker.errors_by_kind())
        print(f"breaker: opened {guard.breaker.opened}x, errors {kinds}")
        await load.close()
        await guard.aclose()
        if relay is not None:
            relay.terminate()
            relay.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fault", choices=["kill", "freeze", "halfopen"], default="kill")
    ap.add_argument("--down", type=float, default=5.0, help="seconds the fault lasts")
    ap.add_argument("--after", type=float, default=4.0, help="seconds run after the fault")
    ap.add_argument("--workers", type=int, default=50)
    ap.add_argument("--deadline", type=float, default=0.1, help="request deadline, s")
    asyncio.run(run(ap.parse_args()))


if __name__ == "__main__":
    main()
