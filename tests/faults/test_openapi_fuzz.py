"""``GET /openapi.json`` describes every endpoint the router answers, the fast path's
included; a bounded schemathesis run through it finds no 5xx from the router.

The fuzzed router is a real `kvroute serve` process in front of two real `kvroute sim`
processes (``--time-scale 0``: they answer at once), all on loopback, all healthy: so
no answer may be a 5xx (a 502/503/504 names a pod failure, and no pod fails here).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from router.proxy.settings import PASSTHROUGH_PATHS
from tests.support.sim_process import sim_processes

MODEL = "fuzz-model"
GUARD_S = 60.0


@pytest.fixture(scope="module")
def router_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with sim_processes(["sim-0", "sim-1"], MODEL, "--time-scale", "0") as pods:
        config = tmp_path_factory.mktemp("fuzz") / "router.yaml"
        static = [{"name": n, "url": p.url, "models": [MODEL]} for n, p in pods.items()]
        config.write_text(
            json.dumps(
                {
                    "port": 0,
                    "discovery": {"static": static},
                    "events": {"enabled": False},
                    "fleet": {"enabled": False},
                }
            )
        )
        cmd = [sys.executable, "-m", "router.cli", "serve", "--config", str(config)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env)
        try:
            url = _listening_url(proc)
            yield url
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _listening_url(proc: subprocess.Popen[bytes]) -> str:
    """The URL uvicorn says it listens on (``--port 0`` picks a free port)."""
    assert proc.stderr is not None
    for raw in proc.stderr:
        line = raw.decode(errors="replace")
        m = re.search(r"Uvicorn running on (http://\S+)", line)
        if m:
            return m.group(1)
    raise RuntimeError(f"kvroute serve exited ({proc.wait()}) before listening")


def test_the_document_lists_the_fast_path_endpoints_with_their_bodies(router_url: str) -> None:
    doc = httpx.get(f"{router_url}/openapi.json", timeout=GUARD_S).json()
    paths = doc["paths"]
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"):
        assert "post" in paths[path], path
        assert "requestBody" in paths[path]["post"], path
    for path in ("/v1/route", "/v1/models", "/health", "/ready", "/metrics"):
        assert path in paths, path
    for path in PASSTHROUGH_PATHS:
        assert "post" in paths[path], path
    assert "/v1/responses/{response_id}" in paths
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]
    assert {"model", "messages"} <= set(chat["required"])
    assert {"stream", "max_tokens", "temperature"} <= set(chat["properties"])
    assert chat["properties"]["model"]["examples"] == [MODEL]  # what the fleet serves
    completion = doc["components"]["schemas"]["CompletionRequest"]
    assert {"model", "prompt"} <= set(completion["required"])


schema = schemathesis.pytest.from_fixture("router_schema")


@pytest.fixture(scope="module")
def router_schema(router_url: str) -> Any:
    return schemathesis.openapi.from_url(f"{router_url}/openapi.json")


@schema.parametrize()
@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
    database=None,
)
def test_fuzzing_the_router_through_its_openapi_document_finds_no_5xx(case: Any) -> None:
    response = case.call(timeout=GUARD_S)
    assert response.status_code < 500, (
        f"{case.method} {case.path} answered {response.status_code}: {response.text[:500]}\n"
        f"body: {str(case.body)[:500]}"
    )
