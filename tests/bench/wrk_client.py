"""The load clients of bench_wrk_overhead.py: ``wrk`` (closed loop, with a Lua script
that prints one JSON line of results) and a raw-socket streaming client that times the
first body chunk (TCP_NODELAY).  Only 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path

from bench_router_overhead import run_ttft as overhead_ttft

#: wrk's Lua: the POST body, and one JSON line of results at the end
WRK_LUA = """
wrk.method = "POST"
wrk.body = %s
wrk.headers["Content-Type"] = "application/json"
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'WRKJSON {"requests": %%d, "duration_us": %%d, "errors": %%d, "non2xx": %%d, ' ..
    '"p50_us": %%d, "p99_us": %%d, "mean_us": %%.1f}\\n',
    summary.requests, summary.duration, e.connect + e.read + e.write + e.timeout, e.status,
    latency:percentile(50), latency:percentile(99), latency.mean))
end
"""


@dataclass
class Wrk:
    requests: int
    seconds: float
    errors: int
    non2xx: int
    p50_ms: float
    p99_ms: float

    @property
    def rps(self) -> float:
        return self.requests / self.seconds


def run_wrk(script: Path, port: int, threads: int, conns: int, seconds: float) -> Wrk:
    out = subprocess.run(
        [
            *["wrk", f"-t{threads}", f"-c{conns}", f"-d{seconds:g}s", "--timeout", "10s"],
            *["-s", str(script), f"http://127.0.0.1:{port}/v1/completions"],
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    line = next(x for x in out.splitlines() if x.startswith("WRKJSON "))
    d = json.loads(line[len("WRKJSON ") :])
    return Wrk(
        d["requests"],
        d["duration_us"] / 1e6,
        d["errors"],
        d["non2xx"],
        d["p50_us"] / 1e3,
        d["p99_us"] / 1e3,
    )


def run_ttft(port: int, n: int, body: dict[str, object]) -> float:
    """p50 time to the first body chunk of ``n`` streaming completions of ``body``
    (after 10 unmeasured), in ms: bench_router_overhead.py's probe."""
    times = asyncio.run(overhead_ttft(port, n, json.dumps(body).encode()))
    return statistics.median(times) * 1e3
