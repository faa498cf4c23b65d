"""`kvroute serve --workers N`: one /metrics for all worker processes
(router/metrics_share.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.metrics_share import merge
from tests.router.test_app_serve import free_port, sigterm

WORKER_A = """\
# HELP kvroute_requests_total Requests answered
# TYPE kvroute_requests_total counter
kvroute_requests_total{pod="sim-0",status="200"} 3.0
kvroute_requests_total{pod="sim-1",status="200"} 1.0
kvroute_requests_created{pod="sim-0",status="200"} 1700000100.0
# HELP kvroute_events_ingested_total KV events applied
# TYPE kvroute_events_ingested_total counter
kvroute_events_ingested_total{pod="sim-0"} 50.0
# HELP kvroute_inflight_requests Requests in flight
# TYPE kvroute_inflight_requests gauge
kvroute_inflight_requests{pod="sim-0"} 2.0
# HELP kvroute_index_entries Index entries
# TYPE kvroute_index_entries gauge
kvroute_index_entries{pod="sim-0"} 120.0
# HELP kvroute_ttft_seconds TTFT
# TYPE kvroute_ttft_seconds histogram
kvroute_ttft_seconds_bucket{le="0.1"} 2.0
kvroute_ttft_seconds_bucket{le="+Inf"} 3.0
kvroute_ttft_seconds_count 3.0
kvroute_ttft_seconds_sum 0.4
"""

WORKER_B = """\
# HELP kvroute_requests_total Requests answered
# TYPE kvroute_requests_total counter
kvroute_requests_total{pod="sim-0",status="200"} 5.0
kvroute_requests_total{pod="sim-0",status="502"} 1.0
kvroute_requests_created{pod="sim-0",status="200"} 1700000050.0
# HELP kvroute_events_ingested_total KV events applied
# TYPE kvroute_events_ingested_total counter
kvroute_events_ingested_total{pod="sim-0"} 48.0
# HELP kvroute_inflight_requests Requests in flight
# TYPE kvroute_inflight_requests gauge
kvroute_inflight_requests{pod="sim-0"} 1.0
# HELP kvroute_index_entries Index entries
# TYPE kvroute_index_entries gauge
kvroute_index_entries{pod="sim-0"} 118.0
# HELP kvroute_ttft_seconds TTFT
# TYPE kvroute_ttft_seconds histogram
kvroute_ttft_seconds_bucket{le="0.1"} 1.0
kvroute_ttft_seconds_bucket{le="+Inf"} 1.0
kvroute_ttft_seconds_count 1.0
kvroute_ttft_seconds_sum 0.05
"""


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def test_merged_metrics_add_the_request_path_and_keep_the_largest_of_shared_inputs() -> None:
    out = samples(merge([WORKER_A, WORKER_B]).decode())
    ok0 = (("pod", "sim-0"), ("status", "200"))
    assert out[("kvroute_requests_total", ok0)] == 8  # each worker served its own
    assert out[("kvroute_requests_total", (("pod", "sim-1"), ("status", "200")))] == 1
    assert out[("kvroute_requests_total", (("pod", "sim-0"), ("status", "502")))] == 1
    assert out[("kvroute_requests_created", ok0)] == 1700000050  # the earliest
    # every worker applies every KV event to its own index: counted once, not N times
    assert out[("kvroute_events_ingested_total", (("pod", "sim-0"),))] == 50
    assert out[("kvroute_inflight_requests", (("pod", "sim-0"),))] == 3  # in flight adds up
    assert out[("kvroute_index_entries", (("pod", "sim-0"),))] == 120  # the same fleet
    assert out[("kvroute_ttft_seconds_bucket", (("le", "0.1"),))] == 3
    assert out[("kvroute_ttft_seconds_count", ())] == 4
    assert out[("kvroute_ttft_seconds_sum", ())] == pytest.approx(0.45)


def test_one_worker_merges_to_itself() -> None:
    assert samples(merge([WORKER_A]).decode()) == samples(WORKER_A)


def requests_total(text: str) -> float:
    return sum(
        s.value
        for fam in text_string_to_metric_families(text)
        if fam.name == "kvroute_requests"
        for s in fam.samples
        if s.name == "kvroute_requests_total"
    )


@pytest.mark.slow
def test_two_workers_answer_metrics_for_both(tmp_path: Path) -> None:
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    env["KVROUTE_METRICS_SHARE_DIR"] = str(tmp_path)
    proc = subprocess.Popen(
        [
            *[sys.executable, "-m", "router.cli", "serve", "--port", str(port)],
            *["--workers", "2", "--fleet.pods", "2", "--log-level", "warning"],
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    body = {"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]}
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("*.prom"))) < 2:  # both workers up and sharing
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            assert time.monotonic() < deadline, "the two workers never shared their metrics"
            time.sleep(0.1)
        sent = 0
        per_worker: list[float] = []
        while time.monotonic() < deadline:
            for _ in range(20):  # a new connection each: the kernel picks the worker
                r = httpx.post(base + "/v1/chat/completions", json=body, timeout=30)
                assert r.status_code == 200, r.text
                sent += 1
            time.sleep(1.5)  # every worker has written its file since
            per_worker = [requests_total(p.read_text()) for p in tmp_path.glob("*.prom")]
            if len(per_worker) == 2 and min(per_worker) > 0:
                break
        assert len(per_worker) == 2 and min(per_worker) > 0, "one worker served everything"
        assert sum(per_worker) == sent
        for _ in range(6):  # whichever worker answers, it answers for both
            assert requests_total(httpx.get(base + "/metrics").text) == sent
    finally:
        code = sigterm(proc)
    assert code == 0
    assert not list(tmp_path.glob("*.prom"))  # each worker removed its file on the way out
