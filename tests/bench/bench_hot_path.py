"""Where the router's CPU per request goes, in process (no uvicorn, no client socket).

    python tests/bench/bench_hot_path.py [--requests 30000] [--policy cost] \
        [--router-args=--no-events.enabled]

Starts 4 simulated pods (``kvroute sim --time-scale 0``), builds `kvroute serve`'s app
in this process and reports CPU microseconds per request (``time.process_time``) for:

* ``decide``       — ``RequestRouter.decide`` alone (parse, validate, tokenize, hash, look
                     up, pick) on the tiny completion of bench_router_overhead.py, plus
                     the policy's routed/complete bookkeeping;
* ``app``          — the whole ASGI app per request, 32 concurrent callers: decide, proxy
                     bookkeeping and metrics, the pod's HTTP exchange (our side of the
                     socket), the response messages;
* ``relay floor``  — a bare ASGI relay on the same pod transport (round robin, no routing,
                     no metrics): what ``app`` costs with nothing of kvroute's own.

``app - relay floor`` is the routing work per request; uvicorn and the client socket come
on top of ``app`` (bench_router_overhead.py measures the whole process).  The pods run in
other processes, so their CPU is not counted.  Only 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_router_overhead as overhead

from router.config import Settings
from router.decision.request import parse_body
from router.proxy.app import create_app

App = Callable[[dict[str, Any], Any, Any], Awaitable[None]]
BODY = overhead.BODY
HEADERS = [(b"host", b"127.0.0.1"), (b"content-type", b"application/json")]


def scope() -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [*HEADERS, (b"content-length", b"%d" % len(BODY))],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }


async def call(app: App, statuses: dict[int, int]) -> None:
    """One request through ``app`` as uvicorn would make it (one body message)."""
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": BODY, "more_body": False}
        await asyncio.Event().wait()  # never disconnects
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses[message["status"]] = statuses.get(message["status"], 0) + 1

    await app(scope(), receive, send)


async def cpu_per_request(app: App, n: int, concurrency: int = 32) -> float:
    statuses: dict[int, int] = {}

    async def worker(k: int) -> None:
        for _ in range(k):
            await call(app, statuses)

    await asyncio.gather(*(worker(20) for _ in range(concurrency)))  # warm up
    statuses.clear()
    t0 = time.process_time()
    await asyncio.gather(*(worker(n // concurrency) for _ in range(concurrency)))
    used = time.process_time() - t0
    done = sum(statuses.values())
    if statuses.get(200, 0) != done:
        raise RuntimeError(f"not every request succeeded: {statuses}")
    return 1e6 * used / done


async def measure(urls: list[str], n: int, extra: list[str]) -> dict[str, float]:
    static = [{"name": f"sim-{i}", "url": u, "models": ["sim-model"]} for i, u in enumerate(urls)]
    settings = Settings.load(
        ["--discovery.static", json.dumps(static), "--log-level", "warning", *extra]
    )
    app = create_app(settings)
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    lifespan = asyncio.create_task(
        app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}, inbox.get, outbox.put)
    )
    await inbox.put({"type": "lifespan.startup"})
    started = await outbox.get()
    if started["type"] != "lifespan.startup.complete":
        raise RuntimeError(f"the app did not start: {started}")
    try:
        gateway = app.state.gateway
        router, policy = gateway.router, gateway.policy
        headers = {"host": "127.0.0.1", "content-type": "application/json"}
        for _ in range(1000):  # warm up
            await router.decide("completion", parse_body(BODY), headers)
        t0 = time.process_time()
        for _ in range(n):
            routed = await router.decide("completion", parse_body(BODY), headers)
            policy.on_routed(routed.route, routed.ranking[0])
            policy.on_first_token(routed.route, routed.ranking[0], 0.01)
            policy.on_finished(routed.route, routed.ranking[0], None)
            policy.on_complete(routed.route, routed.ranking[0])
        decide = 1e6 * (time.process_time() - t0) / n
        whole = await cpu_per_request(app, n)
        floor = await cpu_per_request(overhead.relay_app(urls), n)
    finally:
        await inbox.put({"type": "lifespan.shutdown"})
        await outbox.get()
        await lifespan
    return {"decide": decide, "app": whole, "relay floor": floor}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=30_000)
    ap.add_argument("--pods", type=int, default=4)
    ap.add_argument(
        "--router-args",
        default="",
        help="more `kvroute serve` flags, e.g. '--speculative.routed-ttl-s 2'",
    )
    ap.add_argument("--policy", default="cost", help="routing policy (default cost)")
    args = ap.parse_args()
    sims = [overhead.start_sim(i) for i in range(args.pods)]
    try:
        for _, url in sims:
            overhead.wait_completion(int(url.rsplit(":", 1)[1]))
        extra = ["--policy", args.policy, *shlex.split(args.router_args)]
        result = uvloop.run(measure([u for _, u in sims], args.requests, extra))
    finally:
        for proc, _ in sims:
            proc.stop()
    print("| part | CPU us / request |\n|---|---:|")
    for name, us in result.items():
        print(f"| {name} | {us:.1f} |")
    print(f"| app - relay floor (routing work) | {result['app'] - result['relay floor']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
