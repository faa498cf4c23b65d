"""Where the router's CPU per request goes, in process (no client socket).

    python tests/bench/bench_hot_path.py [--requests 30000] [--policy cost] \
        [--router-args=--no-events.enabled] [--only server]
    valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.out \
        "$(python -c 'import sys; print(sys.executable)')" \
        tests/bench/bench_hot_path.py --only server --requests 3000 --callgrind

Starts 4 simulated pods (``kvroute sim --time-scale 0``), builds `kvroute serve`'s app
in this process and reports CPU microseconds per request (``time.process_time``) for:

* ``decide``       — ``RequestRouter.decide`` alone (parse, validate, tokenize, hash, look
                     up, pick) on the tiny completion of bench_router_overhead.py, plus
                     the policy's routed/complete bookkeeping;
* ``app``          — the whole ASGI app per request, 32 concurrent callers: decide, proxy
                     bookkeeping and metrics, the pod's HTTP exchange (our side of the
                     socket), the response messages;
* ``server``       — the whole server side as `kvroute serve` runs it: raw HTTP/1.1
                     requests (as wrk sends them) fed to kvroute's uvicorn protocol
                     (router.proxy.protocol) on 32 in-memory
                     connections, the app behind it, the response bytes taken from the
                     protocol's transport: ``app`` plus uvicorn and the protocol, less
                     only the client socket's syscalls;
* ``server c1``    — the same, one connection, one request at a time: CPU us from the
                     request's bytes to its answer's write (what a client waits for),
                     and for the whole request (what runs after the write included),
                     medians over the requests;
* ``relay floor``  — a bare ASGI relay on the same pod transport (round robin, no routing,
                     no metrics): what ``app`` costs with nothing of kvroute's own.

``--callgrind`` (run under ``valgrind --tool=callgrind``): the counters are zeroed
before and dumped after each measured stage (``callgrind_control``), and the number of
requests in the dump is printed: the dump's total (``callgrind_annotate FILE.N``,
"PROGRAM TOTALS") over that number is the stage's instructions per request, a measure
that does not move with the machine's load.  The table's microseconds are valgrind's CPU
time, not the stage's (valgrind runs ~50x slower: the health checks' and scrapes'
timeouts are raised, and the disconnect watchers start after 1 s, not 20 ms).  Name the
interpreter itself, not a wrapper script (pyenv's shim): valgrind does not follow into a
child process.

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
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_router_overhead as overhead

from router.config import Settings
from router.decision.request import parse_body
from router.proxy.app import create_app
from scoring.policies.base import Policy

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


class _MemoryTransport(asyncio.Transport):
    """What uvicorn's protocol needs of a client connection, in memory: each write goes
    to ``on_write``."""

    def __init__(self) -> None:
        super().__init__()
        self.on_write: Callable[[bytes], None] = lambda data: None
        self._closing = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8000), "peername": ("127.0.0.1", 1)}.get(name, default)

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.on_write(bytes(data))

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        self._closing = True

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def wire_request() -> bytes:
    """The request as wrk sends it (bench_wrk_overhead.py's headers)."""
    return (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(BODY)
    ) + BODY


def serve_connection(app: App) -> tuple[Any, _MemoryTransport]:
    """kvroute's uvicorn protocol, configured as `kvroute serve` configures it
    (router/proxy/serve.py), connected to a new in-memory transport."""
    import uvicorn
    from uvicorn.server import ServerState

    from router.proxy.protocol import OneWriteHttpToolsProtocol

    config = uvicorn.Config(
        app,
        http=OneWriteHttpToolsProtocol,
        proxy_headers=False,
        server_header=False,
        access_log=False,
        lifespan="off",
        log_level="warning",
    )
    config.load()
    state = ServerState()
    state.default_headers = [(b"date", b"Wed, 02 Dec 2026 00:00:00 GMT")]
    transport = _MemoryTransport()
    protocol = OneWriteHttpToolsProtocol(
        config=config, server_state=state, app_state={}, _loop=asyncio.get_running_loop()
    )
    protocol.connection_made(transport)
    return protocol, transport


async def server_cpu_per_request(app: App, n: int, concurrency: int = 32) -> float:
    """CPU us per request of the protocol + app on in-memory connections (``server``)."""
    loop = asyncio.get_running_loop()
    request = wire_request()
    statuses: dict[bytes, int] = {}

    async def connection(k: int) -> None:
        protocol, transport = serve_connection(app)
        for _ in range(k):
            answered: asyncio.Future[bytes] = loop.create_future()
            transport.on_write = answered.set_result
            protocol.data_received(request)
            status = (await answered)[9:12]
            statuses[status] = statuses.get(status, 0) + 1
        protocol.connection_lost(None)

    await asyncio.gather(*(connection(20) for _ in range(concurrency)))  # warm up
    statuses.clear()
    await callgrind("-z")
    t0 = time.process_time()
    await asyncio.gather(*(connection(n // concurrency) for _ in range(concurrency)))
    used = time.process_time() - t0
    done = sum(statuses.values())
    await callgrind("-d", done)
    if statuses.get(b"200", 0) != done:
        raise RuntimeError(f"not every request succeeded: {statuses}")
    return 1e6 * used / done


async def server_c1_on_path(app: App, n: int) -> tuple[float, float]:
    """One connection, one request at a time (``c1``): the median CPU us per request
    from the request's bytes reaching the protocol to its answer's write (the router's
    work the client waits for), and to the next request (all of it: what runs after the
    write too).  Medians: a request that met a health check or a scrape is an outlier."""
    import statistics

    loop = asyncio.get_running_loop()
    request = wire_request()
    protocol, transport = serve_connection(app)
    waited: list[float] = []
    whole: list[float] = []
    answered: asyncio.Future[float] = loop.create_future()

    def written(data: bytes) -> None:
        answered.set_result(time.process_time())

    transport.on_write = written
    for _ in range(n + 200):  # the first 200 warm up
        answered = loop.create_future()
        start = time.process_time()
        protocol.data_received(request)
        waited.append(await answered - start)
        await asyncio.sleep(0)  # what the router does after the write runs now
        whole.append(time.process_time() - start)
    protocol.connection_lost(None)
    return 1e6 * statistics.median(waited[200:]), 1e6 * statistics.median(whole[200:])


CALLGRIND = False


async def callgrind(command: str, requests: int = 0) -> None:
    """Under callgrind (``--callgrind``): zero (``-z``) or dump (``-d``) this process's
    counters; after a dump, print how many requests it holds (its total over that is
    the instructions per request)."""
    if not CALLGRIND:
        return
    import os

    proc = await asyncio.create_subprocess_exec(
        "callgrind_control", command, str(os.getpid()), stdout=asyncio.subprocess.DEVNULL
    )
    await proc.wait()
    if command == "-d":
        print(
            f"# callgrind: dumped {requests} requests (instructions per request: the "
            f"last dump's PROGRAM TOTALS / {requests})"
        )


async def measure(
    urls: list[str], n: int, extra: list[str], only: str | None = None
) -> dict[str, float]:
    static = [{"name": f"sim-{i}", "url": u, "models": ["sim-model"]} for i, u in enumerate(urls)]
    settings = Settings.load(
        ["--discovery.static", json.dumps(static), "--log-level", "warning", *extra]
    )
    app = create_app(settings)
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    outbox: asyncio.Queue[MutableMapping[str, Any]] = asyncio.Queue()
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
        if CALLGRIND:  # ~50x slower: answers still come before a disconnect watcher starts
            gateway.proxy._watch.after_s = 1.0
        headers = {"host": "127.0.0.1", "content-type": "application/json"}
        for _ in range(1000):  # warm up
            await router.decide("completion", parse_body(BODY), headers)
        # as the proxy: no call of the base class's no-op on_finished (bookkeeping.py)
        finished = type(policy).on_finished is not Policy.on_finished
        t0 = time.process_time()
        for _ in range(n):
            routed = await router.decide("completion", parse_body(BODY), headers)
            policy.on_routed(routed.route, routed.ranking[0])
            policy.on_first_token(routed.route, routed.ranking[0], 0.01)
            if finished:
                policy.on_finished(routed.route, routed.ranking[0], None)
            policy.on_complete(routed.route, routed.ranking[0])
        result = {"decide": 1e6 * (time.process_time() - t0) / n}
        if only in (None, "app"):
            result["app"] = await cpu_per_request(app, n)
        if only in (None, "server"):
            result["server"] = await server_cpu_per_request(app, n)
        if only in (None, "c1"):
            waited, whole = await server_c1_on_path(app, n)
            result["server c1: before the answer is written"] = waited
            result["server c1: the whole request"] = whole
        if only is None:
            result["relay floor"] = await cpu_per_request(overhead.relay_app(urls), n)
    finally:
        await inbox.put({"type": "lifespan.shutdown"})
        await outbox.get()
        await lifespan
    return result


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
    ap.add_argument("--only", choices=["app", "server", "c1"], help="measure decide and this stage")
    ap.add_argument(
        "--callgrind", action="store_true", help="running under callgrind: zero / dump per stage"
    )
    ap.add_argument(
        "--max-tokens",
        type=int,
        default=1,
        help="the completion's max_tokens (default 1: its JSON head is its first token); "
        "more: a JSON answer the router assembles from a stream (proxy.stream_json_answers; "
        "--router-args=--no-proxy.stream-json-answers sends it as it came)",
    )
    args = ap.parse_args()
    if args.max_tokens < 1:
        print("bench_hot_path: --max-tokens must be >= 1", file=sys.stderr)
        return 2
    global CALLGRIND, BODY
    CALLGRIND = args.callgrind
    BODY = json.dumps({**json.loads(overhead.BODY), "max_tokens": args.max_tokens}).encode()
    sims = [overhead.start_sim(i) for i in range(args.pods)]
    try:
        for _, url in sims:
            overhead.wait_completion(int(url.rsplit(":", 1)[1]))
        extra = ["--policy", args.policy, *shlex.split(args.router_args)]
        if args.callgrind:  # ~50x slower: no pod ejected, no scrape gone stale
            extra += [*overhead.QUIET_BACKGROUND, "--proxy.read-timeout-s", "600"]
        result = uvloop.run(measure([u for _, u in sims], args.requests, extra, args.only))
    finally:
        for proc, _ in sims:
            proc.stop()
    print("| part | CPU us / request |\n|---|---:|")
    for name, us in result.items():
        print(f"| {name} | {us:.1f} |")
    if "relay floor" in result:
        print(f"| app - relay floor (routing work) | {result['app'] - result['relay floor']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
