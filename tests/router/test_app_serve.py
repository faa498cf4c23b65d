"""`kvroute serve` as users run it: with no pods configured it starts the embedded
simulated fleet, answers a chat completion, and shuts down cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_serve_without_pods_answers_from_the_embedded_fleet_and_stops_cleanly() -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "router.cli", "serve", "--port", str(port), "--fleet.pods", "2"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(base + "/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            assert time.monotonic() < deadline, "kvroute serve never became ready"
            time.sleep(0.1)
        models = httpx.get(base + "/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["sim-model"]
        r = httpx.post(
            base + "/v1/chat/completions",
            json={"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
        assert r.status_code == 200
        assert r.headers["x-kvroute-pod"] in {"sim-0", "sim-1"}
        assert r.json()["choices"][0]["message"]["content"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0


def test_serve_rejects_an_invalid_flag_value_with_a_message() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    out = subprocess.run(
        [sys.executable, "-m", "router.cli", "serve", "--policy", "fastest"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "unknown policy 'fastest'" in out.stderr
