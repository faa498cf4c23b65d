"""Router overhead as users measure it: ``wrk`` against FastAPI backends, all targets in one run.

    python tests/bench/bench_wrk_overhead.py [--seconds 10] [--rounds 3] [--backends 4]
    python tests/bench/bench_wrk_overhead.py --scaling      # req/s by workers / cores

An independent harness beside bench_router_overhead.py (whose load client and simulated
pods are kvroute's own): the load generator is ``wrk`` (Debian: ``apt-get install wrk``)
with a Lua script for the POST body and a JSON summary, and the backends are
tests/bench/fake_backend.py, FastAPI + uvicorn with pydantic-validated bodies, answering
at once, so each backend request costs about what a real OpenAI server's HTTP layer
costs.  The targets, every one in front of the same ``--backends`` backends:

* ``direct``                — wrk to backend 0 (no router);
* ``kvroute cost``          — ``kvroute serve``, the default policy, with static pods
                              and no KV events (the backends publish none);
* ``kvroute round_robin``   — ``--policy round_robin``;
* ``sglang cache_aware / round_robin``      — sglang-router (its default: cache_aware);
* ``vllm-router cache_aware / round_robin`` — vllm-router (its default: cache_aware);
* ``python floor``          — with ``--floor``: uvicorn with kvroute's server protocol
                              and pod transport relaying round robin, no routing, no
                              metrics (bench_router_overhead.py's): what Python HTTP in
                              and out costs before any routing.

The peers are found in ``--peer-python`` (default: this interpreter; PEERS.md: a venv
with ``pip install sglang-router==0.3.2 vllm-router==0.1.17``) and started with
``HF_HUB_OFFLINE=1 HF_ENDPOINT=http://127.0.0.1:9``; a peer that is not installed is
skipped with a note.

Per target and round (targets interleaved, the order reversed every other round, the
table showing medians over rounds):

* ``c32``: ``wrk -t2 -c32 -d<seconds>`` -> req/s, and CPU per request, from
  /proc/<pid>/stat (user + system, the router's whole process tree: workers included),
  of the router, of the backends, and of the whole box (/proc/stat, non-idle): on a
  small box all of them share, req/s ~ cores / box us per request;
* ``c1``: ``wrk -t1 -c1 -d<seconds>`` -> latency p50 / p99, and the p50 *added* over
  direct's;
* ``router cores``: the router's CPU over the c32 run's wall time (cores it kept busy);
  ``threads``: its threads at the end (a Rust router sizes its pool to its CPUs);
* ``backends used``: per round, the backends that did at least 15% of the backends'
  work in the c32 run (by their CPU): a router that keeps the one repeated prompt on one
  backend shows 1, a round robin 4;
* per round (stderr), for kvroute's targets: what the policy has learned
  (``kvroute_policy_learned``), since a learned slowdown per running request is what
  would move it to spread the prompt;
* ``TTFT``: sequential streaming completions (a small raw-socket client, TCP_NODELAY)
  -> time to the first body chunk, p50.

Isolation: the run re-executes itself inside a loopback-only network namespace
(``ip netns add``; nothing but ``lo`` exists there) when it can (root, ``ip``), and
deletes the namespace at the end; otherwise it runs on 127.0.0.1 and says so.  A
quiet-machine gate waits (up to ``--gate-wait`` s) for the 1-minute load average to fall
below ``--max-load`` before starting, and the table reports the load at each round.

``--baseline DIR``: also run kvroute ``cost`` from the source tree DIR (``kvroute cost
(baseline)``), interleaved with this tree's, so an optimisation's before and after come
from the same run.

``--scaling``: kvroute ``cost`` with ``--workers 1 / 2 / 4`` and the Rust routers
(whose thread pools size themselves to the CPUs they may use), each pinned with
``taskset -c 0`` and ``taskset -c 0,1`` (the backends and wrk are not pinned).  On a
2-core box the router shares those cores with the backends and wrk, so read the
router's us/req (its cost per request) with the req/s: one core holds about
1e6 / us-per-request requests a second of that router.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from bench_router_overhead import (  # noqa: E402
    Proc,
    _proc_tree,
    cpu_seconds,
    free_port,
    start_floor,
    wait_http,
)
from peer_routers import (  # noqa: E402
    peer_tools,
    sglang_command,
    spawn,
    vllm_router_command,
)
from source_tree import tree_cwd, tree_env  # noqa: E402
from wrk_client import WRK_LUA, Wrk, run_ttft, run_wrk  # noqa: E402

MODEL = "fake-model"
#: the prompt every request sends (one identical prompt, as the users' run did)
PROMPT = "Summarise the plot of a short story about a lighthouse keeper in two sentences."
BODY = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
STREAM_BODY = {**BODY, "max_tokens": 8, "stream": True}
NETNS_ENV = "KVROUTE_BENCH_NETNS"


# -- the namespace and the gate ------------------------------------------------------------


def run_in_netns(argv: list[str]) -> int | None:
    """Re-run this script in a fresh loopback-only network namespace; None if that
    cannot be done here (then the caller runs on 127.0.0.1)."""
    if os.environ.get(NETNS_ENV) or os.geteuid() != 0 or shutil.which("ip") is None:
        return None
    name = f"kvroute-bench-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        print(f"# no network namespace ({made.stderr.strip()}): 127.0.0.1", file=sys.stderr)
        return None
    try:
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True)
        child = subprocess.Popen(
            ["ip", "netns", "exec", name, sys.executable, *argv],
            env={**os.environ, NETNS_ENV: name},
        )
        try:
            return child.wait()
        except KeyboardInterrupt:
            child.send_signal(signal.SIGINT)
            return child.wait()
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def wait_quiet(max_load: float, wait_s: float) -> float:
    """Wait until the 1-minute load average is below ``max_load`` (at most ``wait_s``);
    the load it starts at."""
    deadline = time.monotonic() + wait_s
    while True:
        load = os.getloadavg()[0]
        if load < max_load or time.monotonic() >= deadline:
            if load >= max_load:
                print(f"# machine not quiet: load {load:.2f} >= {max_load}", file=sys.stderr)
            return load
        print(f"# waiting for a quiet machine: load {load:.2f}", file=sys.stderr)
        time.sleep(10)


def box_busy_seconds() -> float:
    """CPU seconds the whole machine spent not idle (all cores, /proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


# -- processes -----------------------------------------------------------------------------


@dataclass
class Target:
    name: str
    port: int
    pids: list[int] = field(default_factory=list)

    def threads(self) -> int:
        """Threads of the target's processes (a Rust router sizes its pool to its CPUs)."""
        n = 0
        for pid in self.pids:
            for p in _proc_tree(pid):
                with contextlib.suppress(OSError), open(f"/proc/{p}/status") as f:
                    n += next(int(x.split()[1]) for x in f if x.startswith("Threads:"))
        return n


def learned(port: int) -> str:
    """What a kvroute target's policy has learned (``kvroute_policy_learned`` on its
    /metrics), short: which way it leans decides where the one prompt goes (a learned
    slowdown per running request spreads it).  "" when there is nothing to read."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
            families = list(text_string_to_metric_families(r.read().decode()))
    except (OSError, ValueError):
        return ""
    return ", ".join(
        f"{s.labels.get('quantity')} {s.value:.3g}"
        for f in families
        if f.name == "kvroute_policy_learned"
        for s in f.samples
    )


def pinned(cmd: list[str], cpus: str | None) -> list[str]:
    return cmd if cpus is None else ["taskset", "-c", cpus, *cmd]


def start_backend(i: int) -> tuple[Proc, str]:
    p = subprocess.Popen(
        [sys.executable, str(HERE / "fake_backend.py"), "--name", f"b{i}", "--model", MODEL],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert p.stdout is not None
    url = str(json.loads(p.stdout.readline())["url"])
    wait_http(int(url.rsplit(":", 1)[1]))
    return Proc(f"backend-{i}", p), url


def completion_ok(port: int) -> bool:
    data = json.dumps(BODY).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(head + data)
            return s.recv(64).startswith(b"HTTP/1.1 200")
    except OSError:
        return False


def wait_completion(port: int, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"exited with {proc.returncode} before answering")
        if completion_ok(port):
            return
        time.sleep(0.3)
    raise RuntimeError(f"port {port} never answered a completion")


def start_kvroute(
    urls: list[str],
    policy: str,
    workers: int = 1,
    cpus: str | None = None,
    tree: str | None = None,
) -> tuple[Proc, int]:
    """``tree``: run the kvroute of that source tree (PYTHONPATH) instead of this one."""
    port = free_port()
    static = [{"name": f"b{i}", "url": u, "models": [MODEL]} for i, u in enumerate(urls)]
    env = tree_env(tree, {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")})
    cmd = [
        sys.executable,
        *f"-m router.cli serve --port {port} --workers {workers} --policy {policy}".split(),
        *["--log-level", "warning", "--discovery.static", json.dumps(static)],
    ]
    p = subprocess.Popen(
        pinned(cmd, cpus),
        env=env,
        cwd=tree_cwd(tree),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_completion(port, p)
    return Proc(f"kvroute {policy}", p), port


def start_sglang(
    py: str, urls: list[str], policy: str, cpus: str | None = None
) -> tuple[Proc, int]:
    port, mport = free_port(), free_port()
    p = spawn(pinned(sglang_command(py, port, mport, urls, policy), cpus))
    wait_completion(port, p)
    return Proc(f"sglang {policy}", p), port


def start_vllm_router(
    exe: str, urls: list[str], policy: str, cpus: str | None = None
) -> tuple[Proc, int]:
    port, mport = free_port(), free_port()
    p = spawn(pinned(vllm_router_command(exe, port, mport, urls, policy), cpus))
    wait_completion(port, p)
    return Proc(f"vllm-router {policy}", p), port


# -- measurements --------------------------------------------------------------------------


@dataclass
class Sample:
    c32: Wrk
    c1: Wrk | None
    ttft_ms: float
    router_us: float
    backends_us: float
    box_us: float
    load: float
    #: backends that did at least USED_SHARE of the backends' work in the c32 run
    backends_used: int


#: a backend with this share of the backends' CPU in a c32 run served it (the others
#: only answered health checks): how many a router spread one repeated prompt over
USED_SHARE = 0.15


def measure(
    target: Target,
    backend_pids: list[int],
    script: Path,
    seconds: float,
    ttft_n: int,
    c1: bool = True,
) -> Sample:
    load = os.getloadavg()[0]
    each0 = [cpu_seconds([pid]) for pid in backend_pids]  # (each backend's, and their sum)
    r0, x0 = cpu_seconds(target.pids), box_busy_seconds()
    c32 = run_wrk(script, target.port, 2, 32, seconds)
    r1, x1 = cpu_seconds(target.pids), box_busy_seconds()
    each = [cpu_seconds([pid]) - t0 for pid, t0 in zip(backend_pids, each0, strict=True)]
    backends_s = sum(each)
    n = max(1, c32.requests)
    seq = run_wrk(script, target.port, 1, 1, seconds) if c1 else None
    ttft = run_ttft(target.port, ttft_n, STREAM_BODY) if ttft_n else float("nan")
    used = sum(1 for t in each if t >= USED_SHARE * backends_s) if backends_s > 0 else 0
    return Sample(
        c32, seq, ttft, (r1 - r0) / n * 1e6, backends_s / n * 1e6, (x1 - x0) / n * 1e6, load, used
    )


# -- the run -------------------------------------------------------------------------------


Starter = Callable[[], tuple[Proc, int]]


def default_targets(
    urls: list[str], peer_py: str, baseline: str | None = None, floor: bool = False
) -> Iterator[tuple[str, Starter | None]]:
    yield "kvroute cost", partial(start_kvroute, urls, "cost")
    if floor:
        yield "python floor", partial(start_floor, urls)
    if baseline is not None:
        yield "kvroute cost (baseline)", partial(start_kvroute, urls, "cost", tree=baseline)
    yield "kvroute round_robin", partial(start_kvroute, urls, "round_robin")
    sglang, vllm = peer_tools(peer_py)
    for policy in ("cache_aware", "round_robin"):
        yield (
            f"sglang {policy}",
            None if sglang is None else partial(start_sglang, sglang, urls, policy),
        )
    for policy in ("cache_aware", "round_robin"):
        yield (
            f"vllm-router {policy}",
            None if vllm is None else partial(start_vllm_router, vllm, urls, policy),
        )


def scaling_targets(urls: list[str], peer_py: str) -> Iterator[tuple[str, Starter | None]]:
    sglang, vllm = peer_tools(peer_py)
    for cpus in ("0", "0,1"):
        for w in (1, 2, 4):
            yield f"kvroute cost w{w} cpus {cpus}", partial(start_kvroute, urls, "cost", w, cpus)
        yield (
            f"sglang cache_aware cpus {cpus}",
            None if sglang is None else partial(start_sglang, sglang, urls, "cache_aware", cpus),
        )
        yield (
            f"vllm-router round_robin cpus {cpus}",
            None if vllm is None else partial(start_vllm_router, vllm, urls, "round_robin", cpus),
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--backends", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=10.0, help="per wrk run (c32, then c1)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ttft-requests", type=int, default=200, help="0: skip TTFT")
    ap.add_argument("--max-load", type=float, default=0.5, help="quiet-machine gate")
    ap.add_argument("--gate-wait", type=float, default=300.0, help="longest wait for the gate")
    ap.add_argument("--peer-python", default=sys.executable, help="python with the peers")
    ap.add_argument("--only", nargs="*", default=None, help="target names (substrings)")
    ap.add_argument("--scaling", action="store_true", help="workers x cores instead")
    ap.add_argument(
        "--baseline",
        default=None,
        help="another kvroute source tree (e.g. a `git archive` of main): its kvroute "
        "targets run beside this tree's, for before/after numbers from one run",
    )
    ap.add_argument("--no-netns", action="store_true", help="run on 127.0.0.1 as it is")
    ap.add_argument(
        "--floor", action="store_true", help="add the bare Python relay (no routing) target"
    )
    args = ap.parse_args()

    if not args.no_netns and NETNS_ENV not in os.environ:
        rc = run_in_netns(sys.argv)
        if rc is not None:
            return rc
    where = os.environ.get(NETNS_ENV)
    if shutil.which("wrk") is None:
        print("wrk is not installed (Debian: apt-get install wrk)", file=sys.stderr)
        return 2

    start_load = wait_quiet(args.max_load, args.gate_wait)
    procs: list[Proc] = []
    tmp = tempfile.TemporaryDirectory(prefix="kvroute-wrk-")
    script = Path(tmp.name) / "post.lua"
    script.write_text(WRK_LUA % json.dumps(json.dumps(BODY)))
    try:
        urls = []
        for i in range(args.backends):
            proc, url = start_backend(i)
            procs.append(proc)
            urls.append(url)
        backend_pids = [p.popen.pid for p in procs]
        targets = [Target("direct", int(urls[0].rsplit(":", 1)[1]))]
        starters = (
            scaling_targets(urls, args.peer_python)
            if args.scaling
            else default_targets(urls, args.peer_python, args.baseline, args.floor)
        )
        for name, starter in starters:
            if args.only is not None and not any(s in name for s in args.only):
                continue
            if starter is None:
                print(f"# skipped {name}: not installed", file=sys.stderr)
                continue
            try:
                proc, port = starter()
            except RuntimeError as exc:
                print(f"# skipped {name}: {exc}", file=sys.stderr)
                continue
            proc.name = name
            procs.append(proc)
            targets.append(Target(name, port, [proc.popen.pid]))
        for t in targets:  # warm-up: connections, caches, the peers' lazy state
            run_wrk(script, t.port, 2, 32, 1)
        samples: dict[str, list[Sample]] = {t.name: [] for t in targets}
        for r in range(args.rounds):
            order = targets if r % 2 == 0 else targets[::-1]
            for t in order:
                s = measure(
                    t,
                    backend_pids,
                    script,
                    args.seconds,
                    0 if args.scaling else args.ttft_requests,
                    c1=not args.scaling,
                )
                samples[t.name].append(s)
                print(
                    f"# round {r + 1}: {t.name}: c32 {s.c32.rps:,.0f} req/s, router "
                    f"{s.router_us:.0f} us/req, backends {s.backends_us:.0f} us/req "
                    f"({s.backends_used} used), "
                    f"load {s.load:.2f}"
                    + (f"; learned: {learned(t.port)}" if t.name.startswith("kvroute") else ""),
                    file=sys.stderr,
                )
        threads = {t.name: t.threads() for t in targets if t.pids}
        print_table(samples, threads, args, where, start_load)
    finally:
        for p in reversed(procs):
            with contextlib.suppress(Exception):
                p.stop()
        tmp.cleanup()
    return 0


def print_table(
    samples: dict[str, list[Sample]],
    threads: dict[str, int],
    args: argparse.Namespace,
    where: str | None,
    load: float,
) -> None:
    def med(xs: list[float]) -> float:
        return statistics.median(xs) if xs else float("nan")

    def ms(x: float, fmt: str = ".3f") -> str:
        return "" if math.isnan(x) else format(x, fmt)

    loads = [s.load for ss in samples.values() for s in ss]
    c1_part = "" if args.scaling else " / -t1 -c1"
    print(
        f"# wrk -t2 -c32{c1_part}, {args.seconds:g} s each, {args.rounds} rounds (medians), "
        f"{args.backends} FastAPI backends, "
        + (f"network namespace {where} (lo only)" if where else "127.0.0.1 (no namespace)")
        + f"; load at start {load:.2f}, during {min(loads):.2f}-{max(loads):.2f}"
    )
    print(
        "| target | c32 req/s | c32 p99 ms | c1 p50 ms | c1 p50 added | c1 p99 ms "
        "| TTFT p50 ms | router us/req | router cores | threads | backends us/req "
        "| backends used, per round | box us/req | errors |"
    )
    print("|---|" + "---:|" * 13)
    direct_p50 = med([s.c1.p50_ms for s in samples["direct"] if s.c1 is not None])
    for name, ss in samples.items():
        c1s = [s.c1 for s in ss if s.c1 is not None]
        p50 = med([c.p50_ms for c in c1s])
        added = "" if name == "direct" or not c1s else f"{p50 - direct_p50:+.3f}"
        router = cores = ""
        if name != "direct":
            router = f"{med([s.router_us for s in ss]):.0f}"
            cores = f"{med([s.router_us * s.c32.rps / 1e6 for s in ss]):.2f}"
        errors = sum(s.c32.errors + s.c32.non2xx for s in ss)
        errors += sum(c.errors + c.non2xx for c in c1s)
        print(
            f"| {name} | {med([s.c32.rps for s in ss]):,.0f}"
            f" | {med([s.c32.p99_ms for s in ss]):.2f}"
            f" | {ms(p50)} | {added} | {ms(med([c.p99_ms for c in c1s]))}"
            f" | {ms(med([s.ttft_ms for s in ss]))} | {router} | {cores}"
            f" | {threads.get(name, '')} | {med([s.backends_us for s in ss]):.0f}"
            f" | {' / '.join(str(s.backends_used) for s in ss)}"
            f" | {med([s.box_us for s in ss]):.0f} | {errors} |"
        )


if __name__ == "__main__":
    raise SystemExit(main())
