"""The ``kvroute sim`` command: serving until a signal, and rejecting invalid settings."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import pytest

from tests.router.sim_pod_support import GUARD


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_kvroute_sim_serves_until_a_signal_and_exits_cleanly(sig: signal.Signals) -> None:
    cmd = [
        sys.executable, "-m", "router.cli", "sim", "--port", "0", "--model", "cli-m",
        "--pod-name", "cli-p", "--block-size", "32", "--capacity-tokens", "4096",
        "--kv-endpoint", "tcp://127.0.0.1:0", "--replay-endpoint", "tcp://127.0.0.1:0",
        "--encoding", "array", "--time-scale", "0",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline())
        assert info["topic"] == "kv@cli-p@cli-m"
        assert info["events_endpoint"].startswith("tcp://127.0.0.1:")
        with httpx.Client(timeout=GUARD) as c:
            models = c.get(f"{info['url']}/v1/models").json()
            assert models["data"][0]["id"] == "cli-m"
            text = c.get(f"{info['url']}/metrics").text
            assert 'block_size="32"' in text
        proc.send_signal(sig)
        assert proc.wait(timeout=GUARD) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_kvroute_sim_rejects_invalid_settings_with_a_message() -> None:
    from router.sim.main import main

    assert main(["--block-size", "0"]) == 2
