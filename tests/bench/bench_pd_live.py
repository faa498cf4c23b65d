"""Live P/D: cache-aware prefill choice vs round-robin prefill (vLLM's toy proxy), through
the real proxy on simulated pods.

    PYTHONPATH=$PWD python tests/bench/bench_pd_live.py [--conversations 12 --turns 6]

Per variant, a fresh fleet of ``--prefill`` prefill + ``--decode`` decode simulated pods
(``kvroute sim`` in this process, real HTTP and ZMQ KV events on 127.0.0.1, ``time_scale``
1: a prefill of 8,000 tokens/s, 16-token blocks, a 32,768-token cache per pod, so a
prefix hit shortens TTFT and where a conversation prefills matters) and ``kvroute serve``
in front.  The first two variants split every request (``pd.params.always_split``: the
toy proxy's rule), so they differ only in the prefill pod:

* ``cost``         -- ``pd.prefill_policy: cost`` (the router's default policy);
* ``round_robin``  -- ``pd.prefill_policy: round_robin`` (vLLM's toy proxy);
* ``cost_default`` -- ``cost`` with the default split rule (scoring/pd.py: short
  remainders and prompts the decode pod mostly holds go direct, a backed-up prefill
  pool too); its ``split`` column is the share of requests the router split.

Two families, each conversation a sequential chain of streaming chat turns whose history
accumulates (the pods' answers are appended), ``--conversations`` of them concurrently:

* ``multi_turn`` -- 3 shared system prompts (~400 tokens), a ~1,200-token first message,
  then ~150-token user turns;
* ``agentic``    -- one shared ~3,000-token tool preamble, then each step appends a
  ~600-token tool result (agents' long, growing prompts).

Measured at the client: TTFT (request sent -> first content event) p50 / p90, ITL (mean
gap between content events of a request) p50 / p90; from the prefill pods' own
counters: prefix hit rate = hits / queries (tokens).  Seeded text; no constant is tuned
to these numbers (the sim's rates are the embedded fleet's defaults, except the prefill
rate, lowered from 20,000 to 8,000 tokens/s so prefill dominates TTFT as it does on a GPU
for these lengths).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import random
import statistics
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from router.config import FleetSettings, Settings
from router.fleet.embedded import sim_settings, start_pods, static_pods, stop_pods
from router.proxy.app import create_app
from router.proxy.serve import RunningServer

MODEL = "sim-model"
WORDS = ["cache", "prefix", "block", "router", "pod", "token", "latency", "queue", "prompt"]


def text(rng: random.Random, tokens: int) -> str:
    """About ``tokens`` tokens of the builtin (byte) tokenizer."""
    out: list[str] = []
    n = 0
    while n < tokens:
        w = rng.choice(WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)


@contextlib.asynccontextmanager
async def fleet(args: argparse.Namespace, variant: str) -> AsyncIterator[tuple[Any, ...]]:
    policy, default_rule = variant.removesuffix("_default"), variant.endswith("_default")
    fs = FleetSettings(
        pods=0,
        prefill_pods=args.prefill,
        decode_pods=args.decode,
        capacity_tokens=args.capacity,
        prefill_tokens_per_s=args.prefill_rate,
    )
    pods = await start_pods([sim_settings(fs, i, time_scale=1.0) for i in range(len(fs.roles()))])
    try:
        settings = Settings.model_validate(
            {
                "discovery": {"static": [p.model_dump() for p in static_pods(pods)]},
                "fleet": {"enabled": False},
                "health": {"enabled": False},
                "pd": {
                    "prefill_policy": policy,
                    "params": {} if default_rule else {"always_split": True},
                },
                "log_level": "warning",
            }
        )
        app = create_app(settings)
        async with (
            RunningServer(app) as server,
            httpx.AsyncClient(base_url=server.url, timeout=120.0) as client,
        ):
            yield client, pods
    finally:
        await stop_pods(pods)


async def turn(
    client: httpx.AsyncClient, messages: list[dict[str, str]]
) -> tuple[float, float, str]:
    """(TTFT, mean ITL, answer) of one streaming chat turn."""
    body = {"model": MODEL, "messages": messages, "max_tokens": 16, "stream": True}
    t0 = time.perf_counter()
    stamps: list[float] = []
    parts: list[str] = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"status {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0].get("delta", {}).get("content")
            if delta:
                stamps.append(time.perf_counter())
                parts.append(delta)
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return stamps[0] - t0, (statistics.fmean(gaps) if gaps else 0.0), "".join(parts)


async def conversation(
    client: httpx.AsyncClient, family: str, c: int, args: argparse.Namespace, out: list[Any]
) -> None:
    rng = random.Random(f"{args.seed}-{family}-{c}")
    if family == "multi_turn":
        system = text(random.Random(f"system-{c % 3}"), 400)
        messages = [{"role": "system", "content": system}]
        first, later = 1200, 150
    else:
        messages = [{"role": "system", "content": text(random.Random("tools"), 3000)}]
        first, later = 300, 600
    await asyncio.sleep(rng.random() * 0.5)  # staggered starts
    for t in range(args.turns):
        words = text(rng, first if t == 0 else later)
        # an agent's tool result goes in as a user message (the sim's template is plain)
        messages.append({"role": "user", "content": f"[{family} {c} step {t}] {words}"})
        ttft, itl, answer = await turn(client, messages)
        out.append((ttft, itl))
        messages.append({"role": "assistant", "content": answer})
        await asyncio.sleep(args.think_s)


async def hit_rate(client: httpx.AsyncClient, pods: list[Any]) -> float:
    hits = queries = 0.0
    for p in pods:
        if p.settings.role != "prefill":
            continue
        for line in (await client.get(p.url + "/metrics")).text.splitlines():
            if line.startswith("vllm:prefix_cache_hits_total"):
                hits += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:prefix_cache_queries_total"):
                queries += float(line.rsplit(" ", 1)[1])
    return hits / queries if queries else 0.0


async def split_rate(client: httpx.AsyncClient) -> float:
    """The share of requests the router split (its ``kvroute_pd_decisions_total``)."""
    by_reason: dict[str, float] = {}
    for line in (await client.get("/metrics")).text.splitlines():
        if line.startswith("kvroute_pd_decisions_total{"):
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            by_reason[reason] = by_reason.get(reason, 0.0) + float(line.rsplit(" ", 1)[1])
    total = sum(by_reason.values())
    return by_reason.get("split", 0.0) / total if total else 0.0


def q(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(p * len(s)))]


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for family in args.families:
        for variant in args.variants:
            async with fleet(args, variant) as (client, pods):
                out: list[tuple[float, float]] = []
                t0 = time.perf_counter()
                await asyncio.gather(
                    *(conversation(client, family, c, args, out) for c in range(args.conversations))
                )
                wall = time.perf_counter() - t0
                ttft = [a for a, _ in out]
                itl = [b for _, b in out if b > 0]
                rows.append(
                    {
                        "family": family,
                        "variant": variant,
                        "requests": len(out),
                        "hit_rate": await hit_rate(client, pods),
                        "split_rate": await split_rate(client),
                        "ttft_p50_s": q(ttft, 0.5),
                        "ttft_p90_s": q(ttft, 0.9),
                        "itl_p50_ms": 1000 * q(itl, 0.5),
                        "itl_p90_ms": 1000 * q(itl, 0.9),
                        "wall_s": wall,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--think-s", type=float, default=0.2)
    ap.add_argument("--capacity", type=int, default=32768)
    ap.add_argument("--prefill-rate", type=float, default=8000.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--families", nargs="+", default=["multi_turn", "agentic"])
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["cost", "round_robin", "cost_default"],
        help="PREFILL_POLICY (every request split) or PREFILL_POLICY_default (the split rule)",
    )
    args = ap.parse_args()
    rows = asyncio.run(run(args))
    print(
        "| family | prefill choice | requests | split | prefill-pod hit | TTFT p50 / p90 "
        "| ITL p50 / p90 |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['family']} | {r['variant']} | {r['requests']} | {r['split_rate']:.2f} | "
            f"{r['hit_rate']:.3f} | "
            f"{r['ttft_p50_s']:.3f} / {r['ttft_p90_s']:.3f} s | "
            f"{r['itl_p50_ms']:.1f} / {r['itl_p90_ms']:.1f} ms |"
        )


if __name__ == "__main__":
    main()
