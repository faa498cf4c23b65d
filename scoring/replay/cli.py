"""``kvroute replay``: replay a trace against simulated pods, once per policy.

Prints a table (default) or exactly one JSON object on stdout (``--json``)::

    {"ceilings": {"infinite": h, "pooled": h},
     "policies": {NAME: {"hit_rate": h, "ttft_p50_s": x, "ttft_p90_s": x, "ttft_p99_s": x,
                         "e2e_p90_s": x, "json_e2e_p90_s": x | null,
                         "throughput_rps": x, "imbalance": x, ...}},
     "workload": {...}, "trace": {...}, "fleet": {...}}

Progress and warnings go to stderr (a progress bar only on a TTY).  Exit status: 0 ok,
1 trace unreadable or empty, 2 invalid arguments or parameters.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from scoring.policies.registry import PolicyConfigError, available_policies, build_policy
from scoring.replay.ceilings import pooled_ceiling
from scoring.replay.engine import replay_policy
from scoring.replay.fleet_args import DEFAULT_PRESET, fleet_config, fleet_defaults, parse_params
from scoring.replay.presets import ENGINE_PARAMS, PRESETS
from scoring.replay.report import format_table, summarize
from scoring.replay.session_loop import SESSION_MODES
from scoring.replay.simpod import FleetConfig, ReplayConfigError
from scoring.replay.trace import MOONCAKE_BLOCK_TOKENS, Trace, TraceFormatError, load_trace
from scoring.replay.workload import workload_stats

_MAX_REPORTED_ERRORS = 10


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="kvroute replay",
        description="Replay a request trace in virtual time against N simulated pods, per policy.",
    )
    ap.add_argument("trace", help="trace file (JSONL)")
    ap.add_argument("--format", choices=["mooncake", "openai"], default="mooncake")
    ap.add_argument("--pods", type=int, default=8, help="simulated pods (default 8)")
    ap.add_argument(
        "--capacity-tokens",
        type=int,
        default=None,
        help="KV cache per pod, tokens (required with --pod-model simple; vllm: the preset's)",
    )
    ap.add_argument(
        "--pod-speed",
        default=None,
        metavar="S1,S2,...",
        help="each pod's speed, a multiple of the rates (0.5 = half as fast), repeated over "
        "the pods: '1,0.5' on 4 pods = 1, 0.5, 1, 0.5 (default: all 1)",
    )
    ap.add_argument(
        "--pod-model",
        choices=["simple", "vllm"],
        default="simple",
        help="simulated pod: simple (FCFS prefill + approximate decode) or vllm (vLLM V1 "
        "scheduler: continuous batching, chunked prefill, KV blocks, preemption)",
    )
    ap.add_argument(
        "--preset",
        default=None,
        help=f"vllm pod model: engine preset ({', '.join(PRESETS)}; default {DEFAULT_PRESET})",
    )
    ap.add_argument(
        "--preset-file",
        default=None,
        metavar="FILE.json",
        help="vllm pod model: engine preset from a file (what `kvroute calibrate` writes)",
    )
    ap.add_argument(
        "--engine-param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"vllm pod model: override a preset parameter ({', '.join(ENGINE_PARAMS)})",
    )
    ap.add_argument(
        "--policy",
        action="append",
        choices=available_policies(),
        help="policy to replay (repeatable; default: all)",
    )
    ap.add_argument(
        "--param",
        action="append",
        default=[],
        metavar="POLICY.KEY=VALUE",
        help="policy parameter (YAML value), e.g. cost.miss_weight=4",
    )
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    ap.add_argument("--plot", metavar="FILE.png", help="write hit-rate bars and TTFT CDFs")
    ap.add_argument(
        "--report",
        metavar="FILE.html",
        help="write one self-contained HTML page: workload, ceilings, table, plots",
    )
    ap.add_argument(
        "--block-size", type=int, default=None, help="tokens per block (openai; default 16)"
    )
    simple = "simple pod model: "
    ap.add_argument("--prefill-rate", type=float, help=simple + "prompt tokens/s per pod (8000)")
    ap.add_argument("--decode-rate", type=float, help=simple + "tokens/s, one sequence (40)")
    ap.add_argument("--decode-batch-slope", type=float, help=simple + "(0.01)")
    ap.add_argument("--decode-interference", type=float, help=simple + "(0.005)")
    ap.add_argument("--cpu-capacity-tokens", type=int, help=simple + "CPU offload tier per pod (0)")
    ap.add_argument("--cpu-load-rate", type=float, help=simple + "CPU->GPU tokens/s (50000)")
    ap.add_argument("--tokenizer", help="model dir or 'builtin' (openai); else a char estimate")
    ap.add_argument("--default-output-tokens", type=int, default=128)
    ap.add_argument(
        "--answers-in-history",
        action="store_true",
        help="openai: the histories carry the pods' own answers (captured traffic): each "
        "turn's answer is cached where it was generated and hit by the session's next turn",
    )
    ap.add_argument(
        "--arrival-rate", type=float, default=1.0, help="req/s for lines without a timestamp"
    )
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    ap.add_argument(
        "--scrape-interval-s",
        type=float,
        default=0.0,
        help="show the policies each pod's scraped metrics (waiting, running, KV usage) as a "
        "scrape this often would, as the live router's scrape.interval_s (1 s) does; "
        "0 (default): exact at every decision",
    )
    ap.add_argument(
        "--json-share",
        type=float,
        default=0.0,
        help="the share of requests whose clients ask for a JSON answer, replayed as a "
        "router that forwards them as they came sees them: no first token, the prompt's "
        "prefill load held until the answer ends (kvroute serve assembles them from a "
        "stream instead, proxy.stream_json_answers: that is 0, the default)",
    )
    ap.add_argument(
        "--sessions",
        choices=SESSION_MODES,
        default="open",
        help="open (default): every request arrives at its trace time; closed: a "
        "session's next turn arrives its planned gap after its previous answer ends, as "
        "an agent or a chat client sends it (for generated traces, whose gaps are think "
        "times; scoring/replay/session_loop.py)",
    )
    ap.add_argument(
        "--prefill-pods",
        type=int,
        default=0,
        help="P/D mode (simple pod model): prefill pool size; each policy picks the prefill "
        "pod (scoring/pd.py), TTFT, ITL and the disaggregation rate are reported",
    )
    ap.add_argument("--decode-pods", type=int, default=0, help="P/D mode: decode pool size")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def _progress(total: int, label: str, enabled: bool) -> Any:
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=label, file=sys.stderr, unit="req", mininterval=0.5)


def _load(args: argparse.Namespace) -> Trace:
    tokenizer = None
    if args.format == "openai" and args.tokenizer:
        from router.tokenize import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    block_size = args.block_size
    if args.format == "mooncake":
        if block_size not in (None, MOONCAKE_BLOCK_TOKENS):
            raise ReplayConfigError(
                f"block-size must be {MOONCAKE_BLOCK_TOKENS} for mooncake traces "
                f"(hash_ids name 512-token blocks), got {block_size}"
            )
        block_size = MOONCAKE_BLOCK_TOKENS
    elif block_size is None:
        block_size = 16
    if block_size < 1:
        raise ReplayConfigError(f"block-size must be >= 1, got {block_size}")
    if args.arrival_rate <= 0:
        raise ReplayConfigError(f"arrival-rate must be > 0, got {args.arrival_rate}")
    if args.default_output_tokens < 0:
        raise ReplayConfigError(
            f"default-output-tokens must be >= 0, got {args.default_output_tokens}"
        )
    return load_trace(
        args.trace,
        args.format,
        block_size=block_size,
        tokenizer=tokenizer,
        default_output=args.default_output_tokens,
        arrival_rate=args.arrival_rate,
        answers_in_history=args.answers_in_history,
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The replay's result (what ``--json`` prints)."""
    return replay(args)[0]


def replay(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, list[float]]]:
    """(the result, each policy's TTFTs for the plot and the report)."""
    trace = _load(args)
    for lineno, msg in trace.errors[:_MAX_REPORTED_ERRORS]:
        print(f"kvroute replay: {args.trace}:{lineno}: skipped: {msg}", file=sys.stderr)
    if trace.malformed > _MAX_REPORTED_ERRORS:
        print(
            f"kvroute replay: ... {trace.malformed - _MAX_REPORTED_ERRORS} more malformed lines",
            file=sys.stderr,
        )
    if trace.approximate:
        print(
            "kvroute replay: no --tokenizer: token counts and blocks are a CHARACTER "
            "ESTIMATE (~4 chars/token)",
            file=sys.stderr,
        )
    if args.limit is not None:
        if args.limit < 1:
            raise ReplayConfigError(f"limit must be >= 1, got {args.limit}")
        trace.requests = trace.requests[: args.limit]
    if not trace.requests:
        raise TraceFormatError(f"{args.trace}: no valid requests ({trace.malformed} malformed)")
    if not args.scrape_interval_s >= 0:
        raise ReplayConfigError(f"scrape-interval-s must be >= 0, got {args.scrape_interval_s}")
    if not 0.0 <= args.json_share <= 1.0:
        raise ReplayConfigError(f"json-share must be within [0, 1], got {args.json_share}")
    cfg = fleet_config(args, trace.block_size)
    if args.prefill_pods or args.decode_pods:
        if args.scrape_interval_s:
            raise ReplayConfigError("--scrape-interval-s does not apply to P/D mode")
        if args.json_share:
            raise ReplayConfigError("--json-share does not apply to P/D mode")
        if args.sessions != "open":
            raise ReplayConfigError("--sessions closed does not apply to P/D mode")
        if cfg.pod_speed is not None:
            raise ReplayConfigError("--pod-speed does not apply to P/D mode")
        return _replay_pd(args, trace, cfg), {}
    names = args.policy or available_policies()
    overrides = parse_params(args.param, names)
    policies = {
        n: build_policy(n, {**fleet_defaults(n, cfg), **overrides.get(n, {})}) for n in names
    }
    show = sys.stderr.isatty() and not args.no_progress
    result: dict[str, Any] = {
        "ceilings": {},
        "policies": {},
        "workload": workload_stats(trace),
        "trace": {
            "path": str(args.trace),
            "format": trace.fmt,
            "lines": trace.lines,
            "requests": len(trace.requests),
            "malformed": trace.malformed,
            "approximate": trace.approximate,
            "block_size": trace.block_size,
        },
        "fleet": dataclasses.asdict(cfg),
        "scrape_interval_s": args.scrape_interval_s,
        "json_share": args.json_share,
        "sessions": args.sessions,
        "params": {n: p.params.model_dump(mode="json") for n, p in policies.items()},
    }
    result["ceilings"] = {
        "infinite": result["workload"]["reuse_ceiling"],
        "pooled": pooled_ceiling(trace, cfg.pods * cfg.capacity_tokens),
    }
    ttfts: dict[str, list[float]] = {}
    for name, policy in policies.items():
        bar = _progress(len(trace.requests), name, show)
        tick = (lambda _i, b=bar: b.update(1)) if bar is not None else None
        outcome = replay_policy(
            trace,
            policy,
            cfg,
            on_progress=tick,
            scrape_interval_s=args.scrape_interval_s,
            json_share=args.json_share,
            sessions=args.sessions,
        )
        if bar is not None:
            bar.close()
        result["policies"][name] = summarize(outcome)
        ttfts[name] = outcome.ttft_s
    return result, ttfts


def _replay_pd(args: argparse.Namespace, trace: Trace, cfg: Any) -> dict[str, Any]:
    """P/D mode: ``{"pd": {policy: summary}, "fleet": ...}`` (simple pods only)."""
    from scoring.replay.pd_engine import replay_pd_policies

    if not isinstance(cfg, FleetConfig):
        raise ReplayConfigError("--prefill-pods / --decode-pods need --pod-model simple")
    if args.decode_pods < 1 or args.prefill_pods < 0:
        raise ReplayConfigError("P/D mode needs --decode-pods >= 1 and --prefill-pods >= 0")
    if args.plot or args.report:
        raise ReplayConfigError("--plot and --report do not apply to P/D mode")
    names = args.policy or ["cost", "round_robin"]
    overrides = parse_params(args.param, names)
    policies = {
        n: build_policy(n, {**fleet_defaults(n, cfg), **overrides.get(n, {})}) for n in names
    }
    return {
        "pd": replay_pd_policies(trace, policies, cfg, args.prefill_pods, args.decode_pods),
        "fleet": {
            **dataclasses.asdict(cfg),
            "prefill_pods": args.prefill_pods,
            "decode_pods": args.decode_pods,
        },
    }


def check_outputs(args: argparse.Namespace) -> None:
    """Before replaying: every output file can be written (its directory exists and is
    writable) and ``--plot`` has matplotlib; :class:`ReplayConfigError` otherwise."""
    for flag, value in (("--plot", args.plot), ("--report", args.report)):
        if not value:
            continue
        parent = Path(value).resolve().parent
        if not parent.is_dir():
            raise ReplayConfigError(f"{flag} {value}: no such directory: {parent}")
        if not os.access(parent, os.W_OK):
            raise ReplayConfigError(f"{flag} {value}: cannot write in {parent}")
    if args.plot:
        from scoring.replay.plot import PlotUnavailable, require_matplotlib

        try:
            require_matplotlib()
        except PlotUnavailable as exc:
            raise ReplayConfigError(f"--plot: {exc}") from None


def write_outputs(args: argparse.Namespace, result: dict[str, Any], ttfts: Any) -> int:
    """The plot and the report, after the table was printed; 1 when one failed."""
    status = 0
    if args.plot:
        from scoring.replay.plot import write_plot

        try:
            write_plot(args.plot, result, ttfts)
        except Exception as exc:  # the table is out already: say what failed, keep going
            print(f"kvroute replay: --plot {args.plot}: {exc}", file=sys.stderr)
            status = 1
    if args.report:
        from scoring.replay.html import write_report

        try:
            write_report(args.report, result, ttfts)
        except Exception as exc:
            print(f"kvroute replay: --report {args.report}: {exc}", file=sys.stderr)
            status = 1
    return status


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    try:
        check_outputs(args)
        result, ttfts = replay(args)
    except (ReplayConfigError, PolicyConfigError) as exc:
        print(f"kvroute replay: {exc}", file=sys.stderr)
        return 2
    except (TraceFormatError, OSError) as exc:
        print(f"kvroute replay: {exc}", file=sys.stderr)
        return 1
    if args.json:
        json.dump(result, sys.stdout)
        sys.stdout.write("\n")
    elif "pd" in result:
        from scoring.replay.pd_engine import format_pd_table

        print(format_pd_table(result["pd"]))
    else:
        print(format_table(result))
    sys.stdout.flush()
    return write_outputs(args, result, ttfts)
