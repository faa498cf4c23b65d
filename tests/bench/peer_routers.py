"""The peer routers (sglang-router, vllm-router) as both overhead harnesses start them:
where they are found, their command lines and their environment.  Each harness waits
for them in its own way (its own client) and may pin them to CPUs."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

#: the peers try to fetch a tokenizer at start; offline, the failure is not fatal
PEER_ENV = {"HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}


def peer_tools(py: str) -> tuple[str | None, str | None]:
    """(python with sglang_router, vllm-router executable) found from ``py`` (the peers
    may live in a venv of their own: ``--peer-python``)."""
    has_sglang = subprocess.run([py, "-c", "import sglang_router"], capture_output=True)
    sglang = py if has_sglang.returncode == 0 else None
    beside = Path(py).parent / "vllm-router"
    vllm = str(beside) if beside.exists() else shutil.which("vllm-router")
    return sglang, vllm


def sglang_command(
    py: str, port: int, metrics_port: int, urls: list[str], policy: str
) -> list[str]:
    return [
        *[py, "-m", "sglang_router.launch_router", "--host", "127.0.0.1"],
        *f"--port {port} --policy {policy} --prometheus-host 127.0.0.1".split(),
        *["--prometheus-port", str(metrics_port), "--worker-urls", *urls],
    ]


def vllm_router_command(
    exe: str, port: int, metrics_port: int, urls: list[str], policy: str
) -> list[str]:
    return [
        *[exe, *f"--host 127.0.0.1 --port {port} --policy {policy}".split()],
        *["--prometheus-port", str(metrics_port), "--worker-urls", *urls],
    ]


def spawn(cmd: list[str]) -> subprocess.Popen[bytes]:
    """A peer's process, quiet, with :data:`PEER_ENV`."""
    return subprocess.Popen(
        cmd,
        env={**os.environ, **PEER_ENV},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
