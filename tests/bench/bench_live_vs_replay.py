"""Does ``kvroute replay`` rank the policies as a live fleet does?  One workload, two runs.

    ip netns exec bench nice -n 10 python tests/bench/bench_live_vs_replay.py \\
        --seeds 1 2 --rounds 3 [--json-out FILE] [--variant cost@s7-cost=/work/wt/s7-cost]

For each seed, a seeded multi-turn chat workload (``chat_workload.py``: conversations over
a few shared system prompts, history growing turn by turn, fixed send times, fixed
answers in the history) is written as a replay trace, then

* **replay**: ``kvroute replay TRACE --format openai --tokenizer DIR`` with every policy,
  on pods of the same model and parameters as the live pods (``--pod-model simple``:
  prefill rate, decode rate, cache size, no decode interference or batch slope, which
  ``kvroute sim``'s simple model does not have; ``--pod-model vllm``: the same preset);
* **live**: for each policy, fresh ``kvroute sim`` pods (``--time-scale 1``) and a fresh
  ``kvroute serve --policy NAME --policy-params P``, where ``P`` is the parameter set the
  replay printed for that policy (so the live policy is configured exactly as the
  replayed one, fleet rates included); the pods' caches are reset after the router's
  readiness probe; the in-repo client sends the trace's requests at their times.

Per policy: hit rate (replay's; live from the pods' own ``vllm:prefix_cache_hits_total``
/ ``vllm:prefix_cache_queries_total``), TTFT p50 / p90 (replay's virtual time; live, the
client's time to the first byte of the streamed answer), and Kendall's tau-b between the
replay's and the live ordering of the policies by TTFT p90 and by hit rate, per seed and
per round; how much the live ordering moves between rounds (tau between rounds); and the
share of policy pairs the replay separates by more than ``--margin`` whose live order
agrees.  Live runs are interleaved: round r runs every seed's policies in an order
rotated by r, so a burst of load on the shared machine spreads over policies.  The
1-minute load average is recorded per run.

Why the in-repo client and not aiperf: the replay needs the exact requests and their
send times.  aiperf's conversations are closed loop (a turn waits for the previous
answer, which it appends), so its requests depend on timing and on the pod's output;
this client sends fixed bodies at fixed times, which a trace reproduces token for token.
``bench_live_quality.py`` runs aiperf against the same kvroute policies for the headline.

``--param POLICY.KEY=VALUE`` (repeatable) is passed to the replay, whose printed
parameter set the live router takes.  With ``--pod-model vllm`` the replay gives ``cost``
the preset's prefill rate as its prior and leaves its slowdown unset, as shipped (learned
from clean first tokens); ``--param cost.decode_slowdown_per_running=X`` tells it one, as
``kvroute calibrate`` would tell an operator.

``--variant NAME@LABEL=PATH`` adds a row: policy NAME run with ``PYTHONPATH=PATH`` (both
the replay and the live router; the pods stay this checkout's), e.g. another branch's
``cost``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench_live_quality import (
    Pod,
    build_tokenizer,
    reset_cache,
    scrape,
    simple_pod_argv,
    start_kvroute,
    start_pod,
)
from bench_router_overhead import Proc, wait_http
from chat_workload import ChatShape, TimedRequest, generate, send_all, vocabulary, write_trace
from rank_agreement import kendall_tau_b, pair_agreement
from source_tree import tree_cwd, tree_env
from unwind import unwind_on_sigterm

POLICIES = [
    "cost",
    "approx_prefix",
    "precise_prefix",
    "dynamo",
    "llmd",
    "least_load",
    "round_robin",
]


@dataclass(frozen=True)
class Row:
    """One row of the comparison: a policy, optionally from another checkout."""

    name: str
    policy: str
    pythonpath: str | None = None


def parse_variant(text: str) -> Row:
    name, sep, path = text.partition("=")
    policy = name.split("@", 1)[0]
    if not sep or "@" not in name or not Path(path).is_dir():
        raise argparse.ArgumentTypeError(f"--variant wants POLICY@LABEL=DIR, got {text!r}")
    return Row(name, policy, path)


def pct(xs: list[float], q: float) -> float:
    """Nearest-rank percentile, as the replay computes it."""
    s = sorted(xs)
    return s[max(0, min(len(s) - 1, int(-(-q * len(s) // 1)) - 1))] if s else float("nan")


# -- replay ----------------------------------------------------------------------------------


def replay_argv(args: argparse.Namespace, trace: Path, tokenizer: Path) -> list[str]:
    argv = [
        *[sys.executable, "-m", "router.cli", "replay", str(trace), "--format", "openai"],
        *["--tokenizer", str(tokenizer), "--block-size", "16", "--pods", str(args.pods)],
        *["--capacity-tokens", str(args.capacity_tokens), "--pod-model", args.pod_model],
        "--json",
        "--no-progress",
    ]
    if args.replay_scrape_interval_s:  # only when asked: a --variant's older tree lacks it
        argv += ["--scrape-interval-s", str(args.replay_scrape_interval_s)]
    if args.pod_model == "vllm":
        return [*argv, "--preset", args.preset]
    return [
        *argv,
        *["--prefill-rate", str(args.prefill_rate), "--decode-rate", str(args.decode_rate)],
        *["--decode-batch-slope", "0", "--decode-interference", "0"],
    ]


def run_replay(
    args: argparse.Namespace, rows: list[Row], trace: Path, tokenizer: Path
) -> dict[str, dict[str, Any]]:
    """Row name -> the replay's result for it, plus ``params`` (its parameter set)."""
    out: dict[str, dict[str, Any]] = {}
    for path in {r.pythonpath for r in rows}:
        group = [r for r in rows if r.pythonpath == path]
        argv = replay_argv(args, trace, tokenizer)
        for r in group:
            argv += ["--policy", r.policy]
        named = {r.policy for r in group}
        for item in args.param:  # each policy's own, in every group that runs it
            if item.split(".", 1)[0] in named:
                argv += ["--param", item]
        done = subprocess.run(
            argv,
            env=tree_env(path),
            cwd=tree_cwd(path),
            capture_output=True,
            text=True,
            check=False,
        )
        if done.returncode != 0:
            raise RuntimeError(f"kvroute replay failed ({done.returncode}): {done.stderr[-2000:]}")
        res = json.loads(done.stdout)
        for r in group:
            out[r.name] = {**res["policies"][r.policy], "params": res["params"][r.policy]}
            out[r.name]["ceiling_pooled"] = res["ceilings"]["pooled"]
    return out


# -- live ------------------------------------------------------------------------------------


@dataclass
class LiveRun:
    row: str
    seed: int
    round: int
    hit_rate: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    requests: int
    errors: int
    per_pod: list[int]
    send_lag_p99_ms: float
    load_avg: float
    wall_s: float
    #: HTTP status of each failed request (0: no answer: a connection error or timeout)
    error_statuses: list[int] = field(default_factory=list)


def pod_argv(args: argparse.Namespace) -> list[str]:
    if args.pod_model == "vllm":
        return [
            *["--time-scale", "1", "--pod-model", "vllm", "--preset", args.preset],
            *["--capacity-tokens", str(args.capacity_tokens)],
        ]
    return [*simple_pod_argv(args), "--decode-rate", str(args.decode_rate)]


def route_only(port: int, body: dict[str, Any]) -> None:
    """``POST /v1/route``: the router renders, tokenizes and decides, and sends nothing."""
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/route",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        r.read()


def run_live(
    args: argparse.Namespace,
    row: Row,
    params: dict[str, Any],
    reqs: list[TimedRequest],
    seed: int,
    rnd: int,
    tokenizer: Path,
    logdir: Path,
) -> LiveRun:
    procs: list[Proc] = []
    try:
        pods: list[Pod] = []
        with ThreadPoolExecutor(args.pods) as pool:  # pods start in parallel: ~5 s each
            futures = [
                pool.submit(start_pod, i, args, tokenizer, logdir, pod_argv(args))
                for i in range(args.pods)
            ]
            for f in futures:
                with contextlib.suppress(Exception):
                    pods.append(f.result())
                    procs.append(pods[-1].proc)
        if len(pods) < args.pods:
            raise RuntimeError(f"{args.pods - len(pods)} pods did not start: see {logdir}")
        for pod in pods:
            wait_http(int(pod.url.rsplit(":", 1)[1]))
        env = {"PYTHONPATH": row.pythonpath} if row.pythonpath else None
        router, port = start_kvroute(pods, row.policy, tokenizer, logdir, params, env)
        procs.append(router)
        # warm up each pod's and the router's chat template and tokenizer (the first
        # chat costs ~0.5-1 s), then empty every cache: each run starts cold and empty.
        # The router is warmed through /v1/route, which decides but sends nothing: a
        # request routed here would stay in the policy's own state (its hot set, its
        # routing history) after the pods' caches are emptied, which the replay's policy
        # never sees
        warm = [TimedRequest(0.0, "warm-up", reqs[0].body)]
        for pod in pods:
            send_all(int(pod.url.rsplit(":", 1)[1]), warm)
        route_only(port, reqs[0].body)
        for pod in pods:
            reset_cache(pod.url)
        time.sleep(1.0)  # AllBlocksCleared reaches kvroute's index
        before = [scrape(p.url) for p in pods]
        t0 = time.monotonic()
        sent = send_all(port, reqs)
        wall = time.monotonic() - t0
        load_avg = os.getloadavg()[0]
        time.sleep(0.3)  # the last requests' counters
        after = [scrape(p.url) for p in pods]
        if router.popen.poll() is not None:
            raise RuntimeError(f"kvroute {row.name} exited during the run")

        def delta(key: str) -> list[float]:
            return [a[key] - b[key] for a, b in zip(after, before, strict=True)]

        hits = sum(delta("vllm:prefix_cache_hits_total"))
        queries = sum(delta("vllm:prefix_cache_queries_total"))
        ttfts = [s.ttft_s for s in sent if s.ttft_s is not None]
        return LiveRun(
            row=row.name,
            seed=seed,
            round=rnd,
            hit_rate=hits / queries if queries else 0.0,
            ttft_p50_ms=pct(ttfts, 0.5) * 1000,
            ttft_p90_ms=pct(ttfts, 0.9) * 1000,
            requests=len(sent),
            errors=len(sent) - len(ttfts),
            per_pod=[int(x) for x in delta("vllm:request_success_total")],
            send_lag_p99_ms=pct([s.lag_s for s in sent], 0.99) * 1000,
            load_avg=load_avg,
            wall_s=wall,
            error_statuses=[x.status for x in sent if x.ttft_s is None],
        )
    finally:
        for p in reversed(procs):
            with contextlib.suppress(Exception):
                p.stop()


# -- report ----------------------------------------------------------------------------------


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def summarise(
    replay: dict[int, dict[str, dict[str, Any]]],
    runs: list[LiveRun],
    rows: list[Row],
    margin: float,
    calm_lag_ms: float = 250.0,
) -> dict[str, Any]:
    """Per seed: the table's medians, and the agreement of orderings (tau-b over the main
    rows; variants are reported, not ranked, as they replace a main row)."""
    ranked = [r.name for r in rows if r.pythonpath is None]
    out: dict[str, Any] = {}
    for seed, rep in replay.items():
        rs = [r for r in runs if r.seed == seed]
        rounds = sorted({r.round for r in rs})
        live = {
            n: {
                "hit_rate": med([r.hit_rate for r in rs if r.row == n]),
                "ttft_p50_ms": med([r.ttft_p50_ms for r in rs if r.row == n]),
                "ttft_p90_ms": med([r.ttft_p90_ms for r in rs if r.row == n]),
            }
            for n in rep
        }
        agree: dict[str, Any] = {}
        for metric, rkey, scale in (
            ("ttft_p90", "ttft_p90_s", 1000.0),
            ("hit_rate", "hit_rate", 1.0),
        ):
            lkey = "ttft_p90_ms" if metric == "ttft_p90" else "hit_rate"
            rv = [rep[n][rkey] * scale for n in ranked]
            per_round = []
            for k in rounds:
                lv = [
                    getattr(next(r for r in rs if r.row == n and r.round == k), lkey)
                    for n in ranked
                ]
                per_round.append(lv)
            between = [
                kendall_tau_b(a, b) for i, a in enumerate(per_round) for b in per_round[i + 1 :]
            ]
            lmed = [live[n][lkey] for n in ranked]
            agree[metric] = {
                "tau_median_live": kendall_tau_b(rv, lmed),
                "tau_per_round": [kendall_tau_b(rv, lv) for lv in per_round],
                "tau_between_rounds": between,
                "pairs_separated": pair_agreement(rv, lmed, margin),
            }
        # TTFT over the calm runs only: a run whose client sent requests late (the shared
        # machine starved it) also starved the pods' simulated clocks
        calm = {
            n: med([r.ttft_p90_ms for r in rs if r.row == n and r.send_lag_p99_ms <= calm_lag_ms])
            for n in ranked
        }
        kept = [n for n in ranked if calm[n] == calm[n]]  # not NaN: at least one calm run
        agree["ttft_p90_calm"] = {
            "max_send_lag_p99_ms": calm_lag_ms,
            "policies": kept,
            "live_ms": {n: calm[n] for n in kept},
            "tau_median_live": kendall_tau_b(
                [rep[n]["ttft_p90_s"] for n in kept], [calm[n] for n in kept]
            ),
            "pairs_separated": pair_agreement(
                [rep[n]["ttft_p90_s"] for n in kept], [calm[n] for n in kept], margin
            ),
        }
        out[str(seed)] = {"replay": rep, "live": live, "agreement": agree}
    return out


def rank(values: dict[str, float], name: str, among: list[str], lower_better: bool) -> int:
    """1 + how many of ``among`` (other than ``name``) do strictly better than ``name``."""
    v = values[name]
    better = [n for n in among if n != name and (values[n] < v if lower_better else values[n] > v)]
    return 1 + len(better)


def print_report(summary: dict[str, Any], rows: list[Row], runs: list[LiveRun]) -> None:
    ranked = [r.name for r in rows if r.pythonpath is None]
    for seed, s in summary.items():
        rep, live = s["replay"], s["live"]
        rp90 = {n: rep[n]["ttft_p90_s"] * 1000 for n in rep}
        lp90 = {n: live[n]["ttft_p90_ms"] for n in live}
        rhit = {n: rep[n]["hit_rate"] for n in rep}
        lhit = {n: live[n]["hit_rate"] for n in live}
        print(
            f"\n### seed {seed} (pooled ceiling {next(iter(rep.values()))['ceiling_pooled']:.3f})\n"
        )
        print(
            "| policy | hit rate replay / live (rank) | TTFT p50 ms replay / live |"
            " TTFT p90 ms replay / live (rank) | live TTFT p90 ms per round | live hit per round |"
        )
        print("|---|---:|---:|---:|---|---|")
        for r in rows:
            mine = [x for x in runs if x.row == r.name and x.seed == int(seed)]
            mine.sort(key=lambda x: x.round)
            print(
                f"| {r.name} | {rhit[r.name]:.3f} / {lhit[r.name]:.3f}"
                f" ({rank(rhit, r.name, ranked, False)} / {rank(lhit, r.name, ranked, False)}) |"
                f" {rep[r.name]['ttft_p50_s'] * 1000:.0f} / {live[r.name]['ttft_p50_ms']:.0f} |"
                f" {rp90[r.name]:.0f} / {lp90[r.name]:.0f}"
                f" ({rank(rp90, r.name, ranked, True)} / {rank(lp90, r.name, ranked, True)}) |"
                f" {', '.join(f'{x.ttft_p90_ms:.0f}' for x in mine)} |"
                f" {', '.join(f'{x.hit_rate:.3f}' for x in mine)} |"
            )
        if not runs:  # --rounds 0: the replay alone, nothing live to agree with
            continue
        for metric, a in s["agreement"].items():
            sep = a["pairs_separated"]
            if metric == "ttft_p90_calm":
                print(
                    f"\nttft_p90 over calm runs (client send lag p99 <="
                    f" {a['max_send_lag_p99_ms']:.0f} ms), {len(a['policies'])} policies with"
                    f" one: tau-b {a['tau_median_live']:.2f}; pairs the replay separates:"
                    f" {sep['agree']}/{sep['pairs']} agree live; live ms "
                    + ", ".join(f"{n} {v:.0f}" for n, v in a["live_ms"].items())
                )
                continue
            print(
                f"\n{metric}: tau-b replay vs live median {a['tau_median_live']:.2f};"
                f" per round {', '.join(f'{t:.2f}' for t in a['tau_per_round'])};"
                f" live round vs round {', '.join(f'{t:.2f}' for t in a['tau_between_rounds'])};"
                f" pairs the replay separates: {sep['agree']}/{sep['pairs']} agree live"
            )
    if not runs:
        return
    loads = [r.load_avg for r in runs]
    lags = [r.send_lag_p99_ms for r in runs]
    print(
        f"\nload average (1 min) during live runs: median {med(loads):.1f},"
        f" {min(loads):.1f}-{max(loads):.1f}; client send lag p99 median {med(lags):.1f} ms,"
        f" max {max(lags):.1f} ms; errors {sum(r.errors for r in runs)}"
    )


def report_from_file(path: Path, margin: float, calm_lag_ms: float) -> int:
    """Re-print the report of an earlier ``--json-out`` (e.g. with another ``--margin``)."""
    blob = json.loads(path.read_text())
    runs = [LiveRun(**r) for r in blob["runs"]]
    first = next(iter(blob["summary"].values()))["replay"]
    rows = [Row(n, n.split("@", 1)[0], "other" if "@" in n else None) for n in first]
    replay = {int(seed): s["replay"] for seed, s in blob["summary"].items()}
    print_report(summarise(replay, runs, rows, margin, calm_lag_ms), rows, runs)
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rounds", type=int, default=3, help="live runs per policy and seed")
    ap.add_argument("--policies", nargs="+", default=POLICIES)
    ap.add_argument("--variant", type=parse_variant, action="append", default=[], metavar="P@L=DIR")
    ap.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="POLICY.KEY=VALUE",
        help="a policy parameter for the replay (YAML value), which the live router then "
        "runs with too, e.g. cost.decode_slowdown_per_running=0.0015: a slowdown told, "
        "where cost as shipped learns one",
    )
    ap.add_argument("--margin", type=float, default=0.10, help="relative gap that separates a pair")
    ap.add_argument(
        "--calm-lag-ms",
        type=float,
        default=250.0,
        help="TTFT is also ranked over the runs whose client send lag p99 is at most this",
    )
    ap.add_argument("--tokenizer", type=Path, default=None, help="directory (built if not given)")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json-out", type=Path, default=None)
    ap.add_argument("--summarise", type=Path, default=None, help="re-print a --json-out; no runs")
    ap.add_argument(
        "--replay-scrape-interval-s",
        type=float,
        default=0.0,
        help="the replay's --scrape-interval-s: 1 shows its policies the pods' scraped "
        "metrics as the live router's 1 s scrapes do (default 0: exact)",
    )
    pod_and_workload_arguments(ap, "pods (the live pods and the replay's)", "simple", ChatShape())
    return ap.parse_args(argv)


def workspace(args: argparse.Namespace, prefix: str) -> tuple[Path, Path, list[str], ChatShape]:
    """The run's directory (``--workdir`` or a new one; ``logs/`` in it), tokenizer
    (``--tokenizer`` or one built there), its words and the workload's shape; sets
    ``args.output_tokens`` (the simple pod model's answer length) to ``--max-tokens``."""
    args.output_tokens = args.max_tokens
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix=prefix))
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    tokenizer = args.tokenizer or build_tokenizer(workdir / "tokenizer")
    shape = ChatShape(**{f: getattr(args, f) for f in asdict(ChatShape())})
    return workdir, tokenizer, vocabulary(tokenizer), shape


def pod_and_workload_arguments(
    ap: argparse.ArgumentParser, title: str, pod_model: str, shape: ChatShape
) -> None:
    """The pods' options (:func:`pod_argv`, ``pod_model`` the default) and the
    workload's (every field of ``shape``, its values the defaults)."""
    g = ap.add_argument_group(title)
    g.add_argument("--pods", type=int, default=4)
    g.add_argument("--pod-model", choices=["simple", "vllm"], default=pod_model)
    g.add_argument("--preset", default="llama3-8b-h100", help="vllm pod model preset")
    g.add_argument("--prefill-rate", type=float, default=4000.0, help="simple: tokens/s")
    g.add_argument("--decode-rate", type=float, default=100.0, help="simple: tokens/s")
    g.add_argument("--capacity-tokens", type=int, default=16384)
    g.add_argument("--max-batch", type=int, default=256, help="simple: running requests")
    g = ap.add_argument_group("workload (chat_workload.ChatShape)")
    for name, value in asdict(shape).items():
        g.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.summarise:
        return report_from_file(args.summarise, args.margin, args.calm_lag_ms)
    unwind_on_sigterm()
    workdir, tokenizer, words, shape = workspace(args, "live-vs-replay-")
    rows = [Row(p, p) for p in args.policies] + args.variant
    print(f"# workdir {workdir}", file=sys.stderr)

    workloads = {s: generate(shape, s, words) for s in args.seeds}
    replay = {
        s: run_replay(args, rows, write_trace(w, workdir / f"trace-s{s}.jsonl"), tokenizer)
        for s, w in workloads.items()
    }
    runs: list[LiveRun] = []
    for rnd in range(args.rounds):
        for seed in args.seeds:
            k = (rnd * len(args.seeds) + args.seeds.index(seed)) % len(rows)
            for row in rows[k:] + rows[:k]:
                params = replay[seed][row.name]["params"]
                run = run_live(
                    args, row, params, workloads[seed], seed, rnd, tokenizer, workdir / "logs"
                )
                runs.append(run)
                print(f"# {json.dumps(asdict(run))}", file=sys.stderr, flush=True)
    summary = summarise(replay, runs, rows, args.margin, args.calm_lag_ms)
    if args.json_out:
        blob = {"args": {k: str(v) for k, v in vars(args).items()}, "summary": summary}
        args.json_out.write_text(json.dumps({**blob, "runs": [asdict(r) for r in runs]}, indent=1))
    print_report(summary, rows, runs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
