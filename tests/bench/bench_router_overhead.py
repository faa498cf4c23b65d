"""Router overhead: tiny non-streaming completions, direct vs through a router.

    python tests/bench/bench_router_overhead.py [--pods 4] [--seconds 5] [--rounds 2]

Starts ``--pods`` simulated vLLM pods (``kvroute sim --time-scale 0``: they answer at
once, so the pod's own time is a small constant), then, on free loopback ports:

* ``direct``          — the client talks to pod 0 (no router);
* ``kvroute w1/w2``   — ``kvroute serve`` with 1 and 2 uvicorn worker processes, default
                        policy (cost), KV events on, in front of all pods;
* ``kvroute w1 round_robin`` — with ``--kvroute-rr``: 1 worker, ``--policy round_robin``
                        (like for like with the peers' round robin);
* ``sglang rr/ca``    — ``sglang-router`` round_robin / cache_aware (if installed in
                        ``--peer-python``, default this interpreter);
* ``vllm-router rr/ca`` — ``vllm-router`` round_robin / cache_aware (beside
                        ``--peer-python``, else on PATH);
* ``python floor``    — with ``--floor``: uvicorn (kvroute's protocol) + kvroute's pod
                        transport relaying round robin, no routing, no metrics: the
                        cost of Python HTTP in and out alone, the part of kvroute's
                        CPU per request that routing code cannot remove.

The load generator is a small raw-socket HTTP/1.1 keep-alive client on its own event
loop (one process), so it costs the same for every target.  For each target:

* c1:  sequential requests -> latency p50 / p99 and *added* latency = target - direct;
* TTFT: sequential *streaming* completions -> time to the first body chunk (p50);
* c32, c128: that many connections for ``--seconds`` -> req/s and latency p50 / p99,
  and CPU per request (user + system, from /proc) of the target's processes
  ("router us/req": every process of the router, workers included), of the pods and
  of this load generator: on a 2-core box that all of them share, req/s is about
  2 cores / (router + pods + client CPU per request).

Targets are measured in rounds, alternating, and the table shows the median over
rounds: on a 2-core machine the pods, the router and the client share the CPUs, so only
numbers from the same run are comparable.  Everything listens on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peer_routers import peer_tools, sglang_command, spawn, vllm_router_command

BODY = json.dumps({"model": "sim-model", "prompt": "hi", "max_tokens": 1}).encode()
STREAM_BODY = json.dumps(
    {"model": "sim-model", "prompt": "hi", "max_tokens": 8, "stream": True}
).encode()


#: under valgrind (~50x slower): no pod ejected, no scrape gone stale, and the router's
#: background work (scrapes, health checks) out of the measured windows
#: (bench_hot_path.py's ``--callgrind``, bench_decide_cost.py's ``--instructions``)
QUIET_BACKGROUND = [
    *("--health.timeout-s", "60", "--health.failure-threshold", "1000"),
    *("--scrape.timeout-s", "60", "--scrape.stale-after-s", "600"),
    *("--scrape.interval-s", "300", "--health.interval-s", "300"),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def request_bytes(port: int, body: bytes = BODY) -> bytes:
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


# -- load generator ------------------------------------------------------------------------


class Conn:
    def __init__(self, port: int) -> None:
        self.port = port
        self.req = request_bytes(port)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        sock = self.writer.get_extra_info("socket")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    async def call(self) -> int:
        assert self.reader is not None and self.writer is not None
        self.writer.write(self.req)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = int(head[9:12])
        length = 0
        chunked = False
        for line in head.split(b"\r\n")[1:]:
            k, _, v = line.partition(b":")
            k = k.strip().lower()
            if k == b"content-length":
                length = int(v)
            elif k == b"transfer-encoding" and b"chunked" in v.lower():
                chunked = True
        if chunked:
            while True:
                size = int((await self.reader.readuntil(b"\r\n")).strip(), 16)
                await self.reader.readexactly(size + 2)
                if size == 0:
                    break
        else:
            await self.reader.readexactly(length)
        return status

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def run_ttft(port: int, n: int, body: bytes = STREAM_BODY) -> list[float]:
    """Streaming completions of ``body``, one at a time, after 10 unmeasured: time to the
    first body chunk (a Nagle or delayed-ACK stall anywhere on the path shows here as
    ~40 ms)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    req = request_bytes(port, body)
    out = []
    for i in range(n + 10):
        t0 = time.perf_counter()
        writer.write(req)
        head = await reader.readuntil(b"\r\n\r\n")
        if b"chunked" not in head.lower():
            raise RuntimeError(f"expected a chunked stream from port {port}: {head[:200]!r}")
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        await reader.readexactly(size + 2)
        if i >= 10:  # warm-up excluded
            out.append(time.perf_counter() - t0)
        while size:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            await reader.readexactly(size + 2)
    writer.close()
    return out


async def run_c1(port: int, n: int) -> list[float]:
    c = Conn(port)
    await c.open()
    for _ in range(20):  # warm up
        await c.call()
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        status = await c.call()
        lat.append(time.perf_counter() - t0)
        if status != 200:
            raise RuntimeError(f"status {status} from port {port}")
    c.close()
    return lat


async def run_concurrent(port: int, conns: int, seconds: float) -> tuple[float, list[float]]:
    cs = [Conn(port) for _ in range(conns)]
    await asyncio.gather(*(c.open() for c in cs))
    lat: list[float] = []
    errors = 0

    async def warm(c: Conn) -> None:
        for _ in range(5):
            await c.call()

    await asyncio.gather(*(warm(c) for c in cs))
    stop_at = time.perf_counter() + seconds

    async def worker(c: Conn) -> None:
        nonlocal errors
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            status = await c.call()
            lat.append(time.perf_counter() - t0)
            if status != 200:
                errors += 1

    t_start = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in cs))
    elapsed = time.perf_counter() - t_start
    for c in cs:
        c.close()
    if errors:
        raise RuntimeError(f"{errors} non-200 answers from port {port}")
    return len(lat) / elapsed, lat


def _proc_tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (Linux /proc)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for tid in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{tid}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return out


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds used so far by ``pids`` and their descendants."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for root in pids:
        for p in _proc_tree(root):
            try:
                with open(f"/proc/{p}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / tick


def self_cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


@dataclass
class Cpu:
    """CPU microseconds per request during one concurrent run."""

    router: float
    pods: float
    client: float


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p * len(xs)))]


# -- processes ------------------------------------------------------------------------------


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(15)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def start_sim(i: int) -> tuple[Proc, str]:
    # under uvloop: it sets TCP_NODELAY on accepted sockets, which plain asyncio skips
    # for SimPod's listening socket (created without IPPROTO_TCP) -> 40 ms Nagle stalls
    code = "import sys, uvloop; uvloop.install(); from router.cli import main; sys.exit(main())"
    p = subprocess.Popen(
        [sys.executable, "-c", code, *f"sim --port 0 --pod-name sim-{i} --time-scale 0".split()],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert p.stdout is not None
    info = json.loads(p.stdout.readline())
    return Proc(f"sim-{i}", p), str(info["url"])


def wait_http(port: int, path: str = "/health", timeout: float = 60.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"nothing answered on port {port}{path}")


def wait_completion(port: int, timeout: float = 60.0) -> None:
    """Until the target routes a completion successfully (routers add workers lazily)."""

    async def probe() -> bool:
        try:
            c = Conn(port)
            await c.open()
            ok = await c.call() == 200
            c.close()
            return ok
        except OSError:
            return False

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if asyncio.run(probe()):
            return
        time.sleep(0.3)
    raise RuntimeError(f"port {port} never answered a completion")


def start_kvroute(urls: list[str], workers: int, policy: str = "cost") -> tuple[Proc, int]:
    port = free_port()
    static = [{"name": f"sim-{i}", "url": u, "models": ["sim-model"]} for i, u in enumerate(urls)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    p = subprocess.Popen(
        [
            sys.executable,
            *f"-m router.cli serve --port {port} --workers {workers}".split(),
            *["--log-level", "warning", "--discovery.static", json.dumps(static)],
            *["--policy", policy],
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_http(port, "/ready")
    suffix = "" if policy == "cost" else f" {policy}"
    return Proc(f"kvroute w{workers}{suffix}", p), port


HERE = Path(__file__).resolve().parent


def relay_app(urls: list[str]) -> Callable[..., Any]:
    """The ``--floor`` target: a bare ASGI relay (round robin over ``urls``) on
    kvroute's pod transport -- no routing, no metrics.  (bench_hot_path.py calls it in
    process.)"""
    from router.fleet.transport import PodTransport

    hosts = [u.split("//")[1].rsplit(":", 1) for u in urls]
    pods = itertools.cycle([(h, int(p)) for h, p in hosts])
    transport = PodTransport()
    drop = {b"content-length", b"date", b"server", b"connection", b"transfer-encoding"}

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = (await receive()).get("body", b"")
        host, pod_port = next(pods)
        head = (
            b"POST %s HTTP/1.1\r\nhost: %s:%d\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n"
            % (scope["path"].encode(), host.encode(), pod_port, len(body))
        )
        up = await transport.send_raw(host, pod_port, head, body, 2.0, 600.0)
        headers = [(k, v) for k, v in up.headers if k.lower() not in drop]
        if up.is_event_stream:
            await send({"type": "http.response.start", "status": up.status, "headers": headers})
            async for chunk in up.stream:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            await up.stream.aclose()
            return
        content = await up.stream.read_all()
        await up.stream.aclose()
        headers.append((b"content-length", b"%d" % len(content)))
        await send({"type": "http.response.start", "status": up.status, "headers": headers})
        await send({"type": "http.response.body", "body": content})

    return app


#: the ``--floor`` process: :func:`relay_app` on uvicorn with kvroute's server protocol
FLOOR_APP = """
import json, sys
sys.path.insert(0, sys.argv[3])
import uvicorn
from bench_router_overhead import relay_app
from router.proxy.serve import OneWriteHttpToolsProtocol

uvicorn.run(relay_app(json.loads(sys.argv[2])), host="127.0.0.1", port=int(sys.argv[1]),
            loop="uvloop", http=OneWriteHttpToolsProtocol, log_level="warning",
            access_log=False, server_header=False)
"""


def start_floor(urls: list[str]) -> tuple[Proc, int]:
    port = free_port()
    p = subprocess.Popen(
        [sys.executable, "-c", FLOOR_APP, str(port), json.dumps(urls), str(HERE)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_completion(port)
    return Proc("python floor", p), port


def start_sglang(py: str | None, urls: list[str], policy: str) -> tuple[Proc, int] | None:
    if py is None:
        return None
    port, mport = free_port(), free_port()
    p = spawn(sglang_command(py, port, mport, urls, policy))
    wait_completion(port)
    return Proc(f"sglang {policy}", p), port


def start_vllm_router(exe: str | None, urls: list[str], policy: str) -> tuple[Proc, int] | None:
    if exe is None:
        return None
    port, mport = free_port(), free_port()
    p = spawn(vllm_router_command(exe, port, mport, urls, policy))
    wait_completion(port)
    return Proc(f"vllm-router {policy}", p), port


# -- main ----------------------------------------------------------------------------------


@dataclass
class Result:
    c1: list[list[float]] = field(default_factory=list)
    ttft: list[list[float]] = field(default_factory=list)
    conc: dict[int, list[tuple[float, list[float]]]] = field(default_factory=dict)
    cpu: dict[int, list[Cpu]] = field(default_factory=dict)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--pods", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=5.0, help="per concurrent measurement")
    ap.add_argument("--c1-requests", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--no-peers", action="store_true", help="skip sglang-router / vllm-router")
    ap.add_argument(
        "--peer-python",
        default=sys.executable,
        help="python with the peers (sglang_router; vllm-router beside it or on PATH)",
    )
    ap.add_argument(
        "--floor", action="store_true", help="add the bare Python relay (no routing) target"
    )
    ap.add_argument(
        "--kvroute-rr",
        action="store_true",
        help="add kvroute w1 with --policy round_robin (like for like with the peers' rr)",
    )
    args = ap.parse_args()

    try:
        import uvloop

        new_loop: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    except ImportError:
        new_loop = asyncio.new_event_loop

    procs: list[Proc] = []
    try:
        urls = []
        for i in range(args.pods):
            proc, url = start_sim(i)
            procs.append(proc)
            urls.append(url)
        pod_pids = [p.popen.pid for p in procs]
        targets: list[tuple[str, int]] = [("direct", int(urls[0].rsplit(":", 1)[1]))]
        target_pids: dict[str, list[int]] = {"direct": []}
        for w in (1, 2):
            proc, port = start_kvroute(urls, w)
            procs.append(proc)
            targets.append((proc.name, port))
            target_pids[proc.name] = [proc.popen.pid]
        if args.kvroute_rr:
            proc, port = start_kvroute(urls, 1, "round_robin")
            procs.append(proc)
            targets.append((proc.name, port))
            target_pids[proc.name] = [proc.popen.pid]
        if args.floor:
            proc, port = start_floor(urls)
            procs.append(proc)
            targets.append((proc.name, port))
            target_pids[proc.name] = [proc.popen.pid]
        if not args.no_peers:
            sglang, vllm = peer_tools(args.peer_python)
            for starter, tool, policy in (
                (start_sglang, sglang, "round_robin"),
                (start_sglang, sglang, "cache_aware"),
                (start_vllm_router, vllm, "round_robin"),
                (start_vllm_router, vllm, "cache_aware"),
            ):
                try:
                    started = starter(tool, urls, policy)
                except RuntimeError as exc:
                    print(f"# skipped {starter.__name__} {policy}: {exc}", file=sys.stderr)
                    continue
                if started is None:
                    print(f"# skipped {starter.__name__}: not installed", file=sys.stderr)
                    continue
                procs.append(started[0])
                targets.append((started[0].name, started[1]))
                target_pids[started[0].name] = [started[0].popen.pid]

        results = {name: Result() for name, _ in targets}
        for r in range(args.rounds):
            order = targets if r % 2 == 0 else list(reversed(targets))
            for name, port in order:
                loop = new_loop()
                try:
                    res = results[name]
                    res.c1.append(loop.run_until_complete(run_c1(port, args.c1_requests)))
                    res.ttft.append(loop.run_until_complete(run_ttft(port, 200)))
                    for c in args.concurrency:
                        cpu0 = (
                            cpu_seconds(target_pids[name]),
                            cpu_seconds(pod_pids),
                            self_cpu_seconds(),
                        )
                        out = loop.run_until_complete(run_concurrent(port, c, args.seconds))
                        n = max(1, len(out[1]))
                        cpu1 = (
                            cpu_seconds(target_pids[name]),
                            cpu_seconds(pod_pids),
                            self_cpu_seconds(),
                        )
                        us = [(b - a) / n * 1e6 for a, b in zip(cpu0, cpu1, strict=True)]
                        res.conc.setdefault(c, []).append(out)
                        res.cpu.setdefault(c, []).append(Cpu(*us))
                finally:
                    loop.close()
                print(f"# round {r + 1}: {name} done", file=sys.stderr)
        print_table(results, args.concurrency)
    finally:
        for p in reversed(procs):
            with contextlib.suppress(Exception):
                p.stop()
    return 0


def print_table(results: dict[str, Result], concurrency: list[int]) -> None:
    def med(xs: list[float]) -> float:
        return statistics.median(xs)

    direct_p50 = med([pct(x, 0.5) for x in results["direct"].c1])
    direct_p99 = med([pct(x, 0.99) for x in results["direct"].c1])
    head = "| target | c1 p50 ms | c1 p99 ms | added p50 ms | added p99 ms | TTFT p50 ms |"
    sep = "|---|---:|---:|---:|---:|---:|"
    for c in concurrency:
        head += f" c{c} req/s | c{c} p50 ms | c{c} p99 ms |"
        head += f" c{c} router us/req | c{c} pods us/req | c{c} client us/req |"
        sep += "---:|---:|---:|---:|---:|---:|"
    print(head)
    print(sep)
    for name, res in results.items():
        p50 = med([pct(x, 0.5) for x in res.c1])
        p99 = med([pct(x, 0.99) for x in res.c1])
        added50 = "" if name == "direct" else f"{(p50 - direct_p50) * 1e3:+.3f}"
        added99 = "" if name == "direct" else f"{(p99 - direct_p99) * 1e3:+.3f}"
        ttft = med([pct(x, 0.5) for x in res.ttft])
        row = f"| {name} | {p50 * 1e3:.3f} | {p99 * 1e3:.3f} | {added50} | {added99} |"
        row += f" {ttft * 1e3:.3f} |"
        for c in concurrency:
            runs = res.conc.get(c, [])
            rps = med([r for r, _ in runs])
            lp50 = med([pct(lat, 0.5) for _, lat in runs])
            lp99 = med([pct(lat, 0.99) for _, lat in runs])
            row += f" {rps:,.0f} | {lp50 * 1e3:.2f} | {lp99 * 1e3:.2f} |"
            cpus = res.cpu.get(c, [])
            router = "" if name == "direct" else f"{med([x.router for x in cpus]):.0f}"
            row += f" {router} | {med([x.pods for x in cpus]):.0f} |"
            row += f" {med([x.client for x in cpus]):.0f} |"
        print(row)


if __name__ == "__main__":
    raise SystemExit(main())
