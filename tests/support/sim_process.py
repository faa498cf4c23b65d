"""`kvroute sim` pods as real processes on loopback, for tests that stop (SIGSTOP) or
kill a pod: an in-process pod cannot hang without hanging the test.

:func:`sim_processes` starts them (each prints its URL once serving), yields them, and
stops each by its PID (SIGCONT first, so a stopped pod can exit; SIGKILL if SIGTERM is
not enough)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import httpx


@dataclass
class SimProcess:
    name: str
    url: str
    proc: subprocess.Popen[bytes]

    def stop_process(self) -> None:
        """SIGSTOP: the pod hangs (its sockets stay open, nothing is answered)."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    async def requests_seen(self) -> int:
        """Requests this pod admitted so far: waiting + running + finished."""
        return await self._gauges(
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:request_success_total",
        )

    async def busy(self) -> int:
        """Requests waiting or running on the pod now."""
        return await self._gauges("vllm:num_requests_running", "vllm:num_requests_waiting")

    async def _gauges(self, *names: str) -> int:
        async with httpx.AsyncClient(timeout=10) as c:
            text = (await c.get(f"{self.url}/metrics")).text
        total = 0.0
        for name in names:
            for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M):
                total += float(m.group(1))
        return int(total)


def _start(name: str, model: str, args: Sequence[str]) -> SimProcess:
    cmd = [
        sys.executable, "-m", "router.cli", "sim", "--port", "0", "--model", model,
        "--pod-name", name, "--no-kv-events", "--replay-endpoint", "none", *args,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait(timeout=10)
        raise RuntimeError(f"kvroute sim {name} exited with {proc.returncode} before serving")
    return SimProcess(name, json.loads(line)["url"], proc)


def _stop(p: SimProcess) -> None:
    if p.proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(p.proc.pid, signal.SIGCONT)
        p.proc.send_signal(signal.SIGTERM)
    try:
        p.proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        p.proc.kill()
        p.proc.wait()


@contextlib.contextmanager
def sim_processes(names: Sequence[str], model: str, *args: str) -> Iterator[dict[str, SimProcess]]:
    """``kvroute sim`` processes named ``names`` serving ``model`` (``args``: more
    `kvroute sim` flags, e.g. ``--time-scale 1 --decode-rate 20``), by name."""
    pods: dict[str, SimProcess] = {}
    try:
        for name in names:
            pods[name] = _start(name, model, args)
        yield pods
    finally:
        for p in pods.values():
            _stop(p)
