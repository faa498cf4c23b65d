"""P/D replay: cache-aware prefill choice vs round robin (vLLM's toy proxy), on the
multi-turn chat and agentic families.

    PYTHONPATH=$PWD python tests/bench/bench_pd_replay.py [--seed 1] [--load 0.6]

Fleet: ``--prefill-pods`` + ``--decode-pods`` simple pods (``FleetConfig`` defaults of
``kvroute replay``: 8,000 prefill tokens/s, 40 decode tokens/s, ``--capacity-tokens``
each).  The trace's arrivals are rescaled to ``--load`` of the whole fleet's pooled
prefill capacity (scoring.replay.offered_load).  Variants, the same decode choice and
split rule (scoring.pd defaults) unless said:

* ``cost``: the prefill pod by the ``cost`` policy over the prefill pool;
* ``round_robin``: the prefill pod in turn;
* ``toy_proxy``: round robin and every request split (vLLM's toy_proxy_server.py).

Deterministic; prints one table per family and the JSON of all numbers.
"""

from __future__ import annotations

import argparse
import json

from scoring.pd import PDParams, PDRouter
from scoring.policies.registry import build_policy
from scoring.replay.families import generate
from scoring.replay.offered_load import scale_to_load
from scoring.replay.pd_engine import replay_pd, summarize_pd
from scoring.replay.simpod import FleetConfig


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--load", type=float, default=0.6)
    ap.add_argument("--prefill-pods", type=int, default=4)
    ap.add_argument("--decode-pods", type=int, default=4)
    ap.add_argument("--capacity-tokens", type=int, default=200_000)
    args = ap.parse_args()
    rate = 8000.0
    out: dict[str, dict[str, dict[str, float]]] = {}
    for family in ("chat", "agentic"):
        trace = generate(family, seed=args.seed)
        pods = args.prefill_pods + args.decode_pods
        whole = FleetConfig(
            pods=pods,
            capacity_tokens=args.capacity_tokens,
            block_size=trace.block_size,
            prefill_rate=rate,
        )
        trace, _ = scale_to_load(trace, whole, args.load)
        cfg = FleetConfig(
            pods=1,
            capacity_tokens=args.capacity_tokens,
            block_size=trace.block_size,
            prefill_rate=rate,
        )
        base = {"prefill_rate_tokens_per_s": rate}
        variants = {
            "cost": PDRouter(build_policy("cost", base), PDParams(prefill_rate_tokens_per_s=rate)),
            "round_robin": PDRouter(
                build_policy("round_robin"), PDParams(prefill_rate_tokens_per_s=rate)
            ),
            "toy_proxy": PDRouter(
                build_policy("round_robin"),
                PDParams(always_split=True, prefill_rate_tokens_per_s=rate),
            ),
        }
        out[family] = {}
        for name, router in variants.items():
            run = replay_pd(trace, router, cfg, args.prefill_pods, args.decode_pods, name)
            out[family][name] = summarize_pd(run)
        print(
            f"\n{family}: {len(trace.requests)} requests, "
            f"{args.prefill_pods}P+{args.decode_pods}D, load {args.load}"
        )
        print(
            f"{'variant':<12} {'split':>6} {'hit':>6} {'TTFT p50':>9} {'TTFT p90':>9} "
            f"{'ITL p50':>8} {'ITL p90':>8}"
        )
        for name, s in out[family].items():
            print(
                f"{name:<12} {s['disaggregation_rate']:>6.2f} {s['hit_rate']:>6.3f} "
                f"{s['ttft_p50_s']:>9.3f} {s['ttft_p90_s']:>9.3f} "
                f"{s['itl_p50_s'] * 1e3:>7.1f}m {s['itl_p90_s'] * 1e3:>7.1f}m"
            )
    print(json.dumps(out))


if __name__ == "__main__":
    main()
