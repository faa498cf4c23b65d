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


def sigterm(proc: subprocess.Popen[bytes]) -> int:
    """Stop ``proc`` as Kubernetes would (SIGTERM); -> its exit status (killed, and the
    test failed, when it does not exit within 30 s)."""
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


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
        code = sigterm(proc)
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


def _start_slow_router(port: int, *extra: str) -> subprocess.Popen[bytes]:
    """`kvroute serve` in front of one embedded pod decoding 50 tokens/s."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    flags = ["--port", str(port), "--fleet.pods", "1", "--fleet.decode-tokens-per-s", "50"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "router.cli", "serve", *flags, *extra],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/ready").status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("kvroute serve never became ready")
        time.sleep(0.1)


def _stream_through_sigterm(proc: subprocess.Popen[bytes], port: int) -> tuple[bytes, int]:
    """A ~1.5 s streaming completion; SIGTERM once its first chunk arrived. Returns the
    streamed body (up to where it ended) and the router's exit status."""
    body = b""
    body_json = {"model": "sim-model", "prompt": "hi", "max_tokens": 75, "stream": True}
    try:
        with httpx.stream(
            "POST", f"http://127.0.0.1:{port}/v1/completions", json=body_json, timeout=30
        ) as r:
            assert r.status_code == 200
            try:
                for chunk in r.iter_raw():
                    if not body:
                        proc.send_signal(signal.SIGTERM)
                    body += chunk
            except httpx.HTTPError:
                pass  # the router cut the stream
        return body, proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_sigterm_lets_an_inflight_stream_finish_within_the_grace_period() -> None:
    port = free_port()
    body, code = _stream_through_sigterm(_start_slow_router(port), port)
    assert body.rstrip().endswith(b"data: [DONE]"), body[-200:]
    assert code == 0


@pytest.mark.slow
def test_sigterm_cuts_streams_still_running_after_the_grace_period() -> None:
    port = free_port()
    proc = _start_slow_router(port, "--shutdown-grace-s", "0")
    body, code = _stream_through_sigterm(proc, port)
    assert body and b"[DONE]" not in body
    assert code == 0
