"""The engine-agreement bench's live fleet: how real vLLM engines are started (and what
the replay and the sim mirror of it), ``kvroute sim`` pods on a calibrated preset, free
ports, health.  Used by bench_engine_agreement.py (its sibling) and its tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from scoring.replay.presets import EngineSpec
from tools.capture_vllm_events import SERVE_SH, VLLM_ROOT

MODEL = "tiny-llama"
BLOCK = 32  # the CPU engine's block size
HTTP_BASE, ZMQ_BASE = 18400, 18450


@dataclass(frozen=True, slots=True)
class EngineSetup:
    """How the real engines are started (and what the replay and the sim mirror).

    ``omp_threads``: the engine's ``OMP_NUM_THREADS``.  With vLLM's default (one OpenMP
    thread per core, 2 here) a step's parallel regions end in barriers that wait for a
    thread the kernel has descheduled whenever the shared cores are busy, and a step
    costs 2-30x its work (docs/replay.md, "Where the real engine's TTFT went"); 1 keeps
    the step time a function of the step's work.  ``cache_blocks``: vLLM's
    ``--num-gpu-blocks-override`` (the replay and the sim get the same KV capacity);
    None = the 1 GiB cache (16,384 blocks).  ``weights``: the model directory under
    ``VLLM_ROOT`` the engines load (``tiny-llama``: 2 layers of 128, whose TTFT is mostly
    the API server's fixed overhead; ``small-llama``: 8 layers of 512, whose prefill
    steps are most of it); served as ``tiny-llama`` either way (serve.sh), with the same
    tokenizer.  ``nice``: see below.
    """

    omp_threads: int | None = 1
    cache_blocks: int | None = None
    #: niceness added to the engines' (relative to this process, which runs the router
    #: and the client): vLLM's engine core and worker poll their shared-memory queues
    #: with ``sched_yield`` for 1 s after every message, so two engines keep 4 processes
    #: runnable on the 2 cores and starve the router's event loop otherwise
    nice: int = 5
    weights: str = MODEL

    def serve_args(self) -> list[str]:
        if self.cache_blocks is None:
            return []
        max_len = min(2048, self.max_model_len)
        return [
            "--num-gpu-blocks-override",
            str(self.cache_blocks),
            "--max-model-len",
            str(max_len),
        ]

    @property
    def max_model_len(self) -> int:
        """vLLM wants one block to spare beyond ``max_model_len`` (64 blocks of 32 tokens
        serve at most 2,016)."""
        return (self.cache_blocks or 1 << 20) * BLOCK - BLOCK

    def env(self) -> dict[str, str]:
        return {} if self.omp_threads is None else {"OMP_NUM_THREADS": str(self.omp_threads)}

    def engine_spec(self, spec: EngineSpec) -> EngineSpec:
        """``spec`` with this setup's KV capacity and ``max_model_len``."""
        if self.cache_blocks is None:
            return spec
        tokens = self.cache_blocks * BLOCK
        return replace(
            spec,
            kv_capacity_tokens=tokens,
            max_model_len=min(spec.max_model_len, self.max_model_len),
        )


# --- live targets -------------------------------------------------------------------


@dataclass(slots=True)
class Pod:
    name: str
    url: str
    events: str
    replay: str
    proc: subprocess.Popen[bytes]

    def stop(self) -> None:
        """SIGTERM by PID, then the process group we created (vLLM's workers)."""
        p = self.proc
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)


def start_engines(
    n: int,
    logdir: Path,
    ports: tuple[int, int] = (HTTP_BASE, ZMQ_BASE),
    setup: EngineSetup = EngineSetup(),
) -> list[Pod]:
    """``n`` real engines on the first free HTTP ports from ``ports[0]`` and ZMQ PUB ports
    from ``ports[1]`` in steps of 5 (replay ROUTER = PUB + 100), started as ``setup``
    says."""
    pods = []
    http, zmq = ports[0] - 1, ports[1] - 5
    for i in range(n):
        http = _next_free(http + 1, 1)
        zmq = _next_free(zmq + 5, 5, also=100)
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", MODEL=str(VLLM_ROOT / setup.weights))
        env.pop("PYTHONHASHSEED", None)
        env.update(setup.env())
        with open(logdir / f"engine-{i}.log", "wb") as log:
            proc = subprocess.Popen(
                ["nice", "-n", str(setup.nice), str(SERVE_SH), str(http), str(zmq), "sha256",
                 *setup.serve_args()],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        pods.append(
            Pod(
                f"vllm-{i}",
                f"http://127.0.0.1:{http}",
                f"tcp://127.0.0.1:{zmq}",
                f"tcp://127.0.0.1:{zmq + 100}",
                proc,
            )
        )
    try:
        for p in pods:
            wait_health(p, 420.0)
    except BaseException:
        for p in pods:
            p.stop()
        raise
    return pods


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _next_free(port: int, step: int, also: int | None = None) -> int:
    """The first port from ``port`` (in ``step``\\ s) free now, with ``port + also``."""
    while not (_port_free(port) and (also is None or _port_free(port + also))):
        port += step
    return port


def start_sims(n: int, preset_file: Path, spec: EngineSpec, logdir: Path) -> list[Pod]:
    """``n`` ``kvroute sim --pod-model vllm`` pods on ``preset_file``, with ``spec``'s KV
    capacity and ``max_model_len``."""
    pods = []
    for i in range(n):
        argv = [
            *[sys.executable, "-m", "router.cli", "sim", "--port", "0", "--pod-name", f"sim-{i}"],
            *["--model", MODEL, "--pod-model", "vllm", "--preset-file", str(preset_file)],
            *["--block-size", str(BLOCK), "--tokenizer", str(VLLM_ROOT / MODEL)],
            *["--capacity-tokens", str(spec.kv_capacity_tokens)],
            *["--max-model-len", str(spec.max_model_len)],
        ]
        with open(logdir / f"sim-{i}.log", "wb") as err:
            proc = subprocess.Popen(
                argv, stdout=subprocess.PIPE, stderr=err, start_new_session=True
            )
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline())
        pods.append(
            Pod(f"sim-{i}", info["url"], info["events_endpoint"], info["replay_endpoint"], proc)
        )
    return pods


def wait_health(pod: Pod, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=2.0) as c:
        while time.monotonic() < deadline:
            if pod.proc.poll() is not None:
                raise RuntimeError(f"{pod.name} exited with code {pod.proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if c.get(pod.url + "/health").status_code == 200:
                    return
            time.sleep(1.0)
    raise RuntimeError(f"{pod.name} not healthy after {timeout:.0f} s")
