"""Soak: the router under steady mixed load for N minutes, with faults on a schedule.

Real processes on loopback: 3 `kvroute sim` pods (their own processes, so one can be
frozen with SIGSTOP and killed), a real valkey-server (killed and restarted on the same
port), and `kvroute serve` with ``redis_url`` + ``index_writer`` (in this process, on a
real socket) in a process of its own (``--in-process``: in this one, sharing the
client's event loop).  A bounded client keeps ``--concurrency`` requests in flight (half
streaming, multi-turn chats over a few system prompts), each with a deadline.

Faults, one per ``--fault-every`` seconds, in turn: a pod frozen (SIGSTOP) for 10 s;
Redis killed for 10 s; a pod killed and started again on its port.  A request that
failed while a fault was active (or within ``--grace`` s after it ended) is counted as
caused by the fault; every other failure is an error of the router.

    python tests/bench/bench_soak.py [--minutes 10] [--concurrency 16]

Prints one row per minute (requests, errors caused by a fault, other errors, p50 / p99
latency, and from the router's /metrics, sampled every 10 s: health ejections and
whether a model was in panic, ``kvroute_health_panic``), then the RSS of the router
process and of the client process after the warm-up minute and at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from router.config import Settings  # noqa: E402
from router.proxy.app import create_app  # noqa: E402
from router.proxy.serve import RunningServer  # noqa: E402
from tests.bench.loopwatch import LoopWatch, top_steps  # noqa: E402
from tests.support.redis_server import FaultyServer  # noqa: E402

MODEL = "sim-model"
SYSTEMS = [f"You are assistant number {i}. Answer in one short line. " * 12 for i in range(4)]


class SimProcess:
    """One `kvroute sim` process on a fixed port (so a restart keeps its address)."""

    def __init__(self, name: str, port: int, kv_port: int, replay_port: int) -> None:
        self.name, self.port, self.kv_port, self.replay_port = name, port, kv_port, replay_port
        self.proc: subprocess.Popen[bytes] | None = None
        self.info: dict[str, str] = {}

    def start(self) -> None:
        cmd = [
            *(sys.executable, "-m", "router.cli", "sim", "--port", str(self.port)),
            *("--pod-name", self.name, "--model", MODEL, "--time-scale", "0.2"),
            *("--kv-endpoint", f"tcp://*:{self.kv_port}"),
            *("--replay-endpoint", f"tcp://*:{self.replay_port}"),
        ]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env, cwd=REPO)
        assert self.proc.stdout is not None
        self.info = json.loads(self.proc.stdout.readline())

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@dataclass
class Result:
    start: float
    latency: float
    ok: bool
    why: str = ""


@dataclass
class Faults:
    windows: list[tuple[float, float, str]] = field(default_factory=list)

    def caused(self, r: Result, grace: float) -> bool:
        end = r.start + r.latency
        return any(a - 1.0 <= end and r.start <= b + grace for a, b, _ in self.windows)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _client(
    client: httpx.AsyncClient, results: list[Result], stop_at: float, deadline_s: float, seed: int
) -> None:
    rng = random.Random(seed)
    history: list[dict[str, str]] = [{"role": "system", "content": rng.choice(SYSTEMS)}]
    turn = 0
    while time.monotonic() < stop_at:
        turn += 1
        if turn % 6 == 0:  # a new conversation
            history = [{"role": "system", "content": rng.choice(SYSTEMS)}]
        history.append({"role": "user", "content": f"question {turn} from client {seed}"})
        stream = rng.random() < 0.5
        body = {"model": MODEL, "messages": history, "max_tokens": 8, "stream": stream}
        t0 = time.monotonic()
        try:
            r = await asyncio.wait_for(
                client.post("/v1/chat/completions", json=body), timeout=deadline_s
            )
            ok = r.status_code == 200 and (not stream or r.text.rstrip().endswith("[DONE]"))
            why = "" if ok else f"status {r.status_code}"
            if ok and not stream:
                history.append(r.json()["choices"][0]["message"])
            elif ok:
                history.append({"role": "assistant", "content": "ok"})
        except (httpx.HTTPError, TimeoutError) as exc:
            ok, why = False, type(exc).__name__
        results.append(Result(t0, time.monotonic() - t0, ok, why))


def _rss_mb(pid: int | str = "self") -> float:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    for line in text.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class RouterProcess:
    """`kvroute serve --config FILE` on a free port, stopped by PID."""

    def __init__(self, config: dict[str, object], work: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        path = work / "router.json"
        path.write_text(json.dumps(config))
        cmd = [sys.executable, "-m", "router.cli", "serve", "--config", str(path)]
        cmd += ["--port", str(self.port)]
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.log = open(work / "router.log", "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=self.log, stderr=self.log)

    async def ready(self) -> None:
        async with httpx.AsyncClient(timeout=2) as c:
            for _ in range(300):
                if self.proc.poll() is not None:
                    raise RuntimeError(f"kvroute serve exited with {self.proc.returncode}")
                try:
                    if (await c.get(self.url + "/ready")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.2)
        raise RuntimeError("kvroute serve never became ready")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _metric_sum(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _faults(
    pods: list[SimProcess], redis: FaultyServer, every: float, stop_at: float, faults: Faults
) -> None:
    kinds = ["freeze", "redis", "restart"]
    i = 0
    await asyncio.sleep(every)
    while time.monotonic() + 12 < stop_at:
        kind = kinds[i % len(kinds)]
        pod = pods[1 + i % (len(pods) - 1)]
        t0 = time.monotonic()
        if kind == "freeze":
            pod.signal(signal.SIGSTOP)
            await asyncio.sleep(10)
            pod.signal(signal.SIGCONT)
        elif kind == "redis":
            redis.kill()
            await asyncio.sleep(10)
            redis.restart()
        else:
            pod.stop()
            await asyncio.sleep(2)
            await asyncio.to_thread(pod.start)
        faults.windows.append((t0, time.monotonic(), f"{kind} {pod.name}"))
        i += 1
        await asyncio.sleep(max(0.0, every - (time.monotonic() - t0)))


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * q / 100))]


async def main(args: argparse.Namespace) -> int:
    pods = [SimProcess(f"sim-{i}", _free_port(), _free_port(), _free_port()) for i in range(3)]
    work = Path(tempfile.mkdtemp(prefix="kvroute-soak-"))
    redis = FaultyServer(work)
    try:
        for p in pods:
            p.start()
        static = [
            {
                "name": p.name,
                "url": p.info["url"],
                "events_endpoint": p.info["events_endpoint"].replace("*", "127.0.0.1"),
                "replay_endpoint": p.info["replay_endpoint"].replace("*", "127.0.0.1"),
                "models": [MODEL],
            }
            for p in pods
        ]
        config = {
            "discovery": {"static": static},
            "fleet": {"enabled": False},
            "redis_url": redis.url,
            "index_writer": True,
            "log_level": "warning",
            "health": {"interval_s": 2.0, "timeout_s": 1.0, "failure_threshold": 2},
            "proxy": {"first_byte_timeout_s": 5.0},
        }
        results: list[Result] = []
        final_metrics = ""
        faults = Faults()
        rss: list[tuple[float, float, float]] = []  # (t, router MB, client MB)
        #: (t, ejections so far, panic, KV-event resyncs so far, queued batches)
        health: list[tuple[float, float, float, float, float]] = []
        async with contextlib.AsyncExitStack() as stack:
            if args.in_process:
                app = create_app(Settings.model_validate(config))
                url = (await stack.enter_async_context(RunningServer(app))).url
                router_pid: int | str = "self"
            else:
                proc = RouterProcess(config, work)
                stack.callback(proc.stop)
                await proc.ready()
                url, router_pid = proc.url, proc.proc.pid
            client = await stack.enter_async_context(
                httpx.AsyncClient(base_url=url, timeout=args.deadline)
            )
            watch = LoopWatch() if args.in_process else None
            loop_samples: list[tuple[float, float, dict[str, float]]] = []
            probe_stop = asyncio.Event()
            if watch is not None:  # the router's loop is this one: watch it
                watch.on = True
                probe = asyncio.create_task(watch.probe(probe_stop))
                stack.push_async_callback(lambda: probe)
                stack.callback(probe_stop.set)
            start = time.monotonic()
            stop_at = start + args.minutes * 60
            tasks = [
                asyncio.create_task(_client(client, results, stop_at, args.deadline, i))
                for i in range(args.concurrency)
            ]
            tasks.append(
                asyncio.create_task(_faults(pods, redis, args.fault_every, stop_at, faults))
            )
            while time.monotonic() < stop_at:
                await asyncio.sleep(10)
                now = time.monotonic() - start
                rss.append((now, _rss_mb(router_pid), _rss_mb()))
                if watch is not None:
                    lag, steps = watch.take()
                    loop_samples.append((now, max(lag, default=0.0), steps))
                try:
                    text = (await client.get("/metrics")).text
                    health.append(
                        (
                            now,
                            _metric_sum(text, "kvroute_health_ejections_total"),
                            _metric_sum(text, "kvroute_health_panic"),
                            _metric_sum(text, "kvroute_event_resyncs_total"),
                            _metric_sum(text, "kvroute_event_queue_depth"),
                        )
                    )
                except httpx.HTTPError:
                    pass
            await asyncio.gather(*tasks, return_exceptions=True)
            with contextlib.suppress(httpx.HTTPError):
                final_metrics = (await client.get("/metrics")).text
        print(f"soak: {args.minutes} min, concurrency {args.concurrency}, faults: "
              + ", ".join(f"{w[2]} at {w[0] - start:.0f} s" for w in faults.windows))  # fmt: skip
        print("| minute | requests | failed, caused by a fault | other errors | p50 s | p99 s "
              "| ejections | panic | event resyncs | max queued batches |")  # fmt: skip
        print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        other_total = 0
        ejected_before = resynced_before = 0.0
        for minute in range(math.ceil(args.minutes)):
            rows = [r for r in results if minute * 60 <= r.start - start < (minute + 1) * 60]
            lat = [r.latency for r in rows if r.ok]
            caused = sum(1 for r in rows if not r.ok and faults.caused(r, args.grace))
            other = sum(1 for r in rows if not r.ok and not faults.caused(r, args.grace))
            other_total += other
            samples = [h for h in health if minute * 60 < h[0] <= (minute + 1) * 60]
            ejected = max((h[1] for h in samples), default=ejected_before)
            panic = "yes" if any(h[2] for h in samples) else "no"
            resynced = max((h[3] for h in samples), default=resynced_before)
            queued = max((h[4] for h in samples), default=0.0)
            print(f"| {minute + 1} | {len(rows)} | {caused} | {other} | "
                  f"{_pct(lat, 50):.3f} | {_pct(lat, 99):.3f} | "
                  f"{ejected - ejected_before:.0f} | {panic} | "
                  f"{resynced - resynced_before:.0f} | {queued:.0f} |")  # fmt: skip
            ejected_before, resynced_before = ejected, resynced
        if loop_samples:
            print("in-process loop, per minute: max lag of a 10 ms sleep; longest steps (CPU ms)")
            for minute in range(math.ceil(args.minutes)):
                got = [x for x in loop_samples if minute * 60 < x[0] <= (minute + 1) * 60]
                merged: dict[str, float] = {}
                for _, _, steps in got:
                    for k, v in steps.items():
                        merged[k] = max(v, merged.get(k, 0.0))
                worst = max((x[1] for x in got), default=0.0)
                print(f"  minute {minute + 1}: lag max {1000 * worst:.0f} ms; {top_steps(merged)}")
        warm = next((r for r in rss if r[0] >= 60), rss[0] if rss else (0.0, 0.0, 0.0))
        end = rss[-1] if rss else (0.0, 0.0, 0.0)
        where = "this process (router + client)" if args.in_process else "the router process"
        print(f"RSS of {where}: {warm[1]:.0f} MB after the first minute, {end[1]:.0f} MB at "
              f"the end; of the client process: {warm[2]:.0f} MB -> {end[2]:.0f} MB")  # fmt: skip
        reasons = collections.Counter[str]()
        for line in final_metrics.splitlines():
            if line.startswith("kvroute_event_resyncs_total{"):
                reason = line.split('reason="', 1)[1].split('"', 1)[0]
                reasons[reason] += int(float(line.rsplit(" ", 1)[1]))
        print(f"KV-event resyncs by reason: {dict(reasons.most_common()) or 'none'}")
        whys = sorted({r.why for r in results if not r.ok})
        print(f"requests {len(results)}; failure kinds: {whys or 'none'}")
        return 1 if other_total else 0
    finally:
        for p in pods:
            p.stop()
        redis.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--deadline", type=float, default=30.0, help="each request's deadline, s")
    ap.add_argument("--fault-every", type=float, default=60.0, help="seconds between faults")
    ap.add_argument("--grace", type=float, default=5.0, help="a fault's effects last this long")
    ap.add_argument(
        "--in-process", action="store_true", help="run the router in this process (shared loop)"
    )
    raise SystemExit(asyncio.run(main(ap.parse_args())))
