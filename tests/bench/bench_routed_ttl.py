"""Does holding every routed chain for a short while (``speculative.routed_ttl_s``, llm-d's
``speculativeTTL`` 2 s) help, with KV events on?

    python tests/bench/bench_routed_ttl.py [--seconds 10] [--burst 8] \
        [--policies cost,precise_prefix]

The gap it covers: between routing a miss and its ``BlockStored`` reaching the index,
no pod is credited with the new prompt, so identical requests arriving meanwhile are
placed as misses too.  Workload: 4 simulated pods (1x time, in this process, real HTTP
and ZMQ), every 300 ms a burst of ``--burst`` identical new prompts (~2,000 tokens,
never seen before) sent at once, plus 4 clients looping on unrelated short prompts.
Reported per policy for ``routed_ttl_s`` 0 (off) and 2: the burst requests' cache-hit ratio (the
pods' ``cached_tokens``), their mean and p90 latency, and how many pods one burst
spread over.  Only 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_recovery as rec

from router.config import Settings
from router.fleet.embedded import start_pods, stop_pods

MODEL = rec.MODEL


async def run(ttl: float, seconds: float, burst: int, policy: str) -> dict[str, Any]:
    bind = f"tcp://127.0.0.1:{rec.free_port()}"
    pods = await start_pods(rec.sims(bind))
    try:
        settings = Settings.model_validate(
            {
                "discovery": {
                    "static": [{"name": p.name, "url": p.url, "models": [MODEL]} for p in pods]
                },
                "fleet": {"enabled": False},
                "log_level": "warning",
                "policy": policy,
                "speculative": {"routed_ttl_s": ttl},
                "events": {"mode": "bind", "bind_endpoint": bind},
            }
        )
        async with rec.serve(settings) as (_, client):
            results: list[tuple[str, int, int, float]] = []
            spread: list[int] = []
            running = True

            async def one(prompt: str) -> tuple[str, int, int, float]:
                t = time.monotonic()
                body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
                r = await client.post("/v1/completions", json=body)
                u = r.json()["usage"]
                cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                return r.headers["x-kvroute-pod"], u["prompt_tokens"], cached, time.monotonic() - t

            async def background(k: int) -> None:
                n = 0
                while running:
                    n += 1
                    await one(f"background {k} request {n}: say hello")

            async def burst_of(prompt: str) -> list[tuple[str, int, int, float]]:
                return list(await asyncio.gather(*(one(prompt) for _ in range(burst))))

            bg = [asyncio.create_task(background(k)) for k in range(4)]
            t0 = time.monotonic()
            n = 0
            pending: list[asyncio.Task[list[tuple[str, int, int, float]]]] = []
            while time.monotonic() - t0 < seconds:
                n += 1
                prompt = f"Burst {n}: a new document to summarise. " + "lorem ipsum " * 165
                pending.append(asyncio.create_task(burst_of(prompt)))
                await asyncio.sleep(0.3)
            for task in pending:
                got = await task
                results.extend(got)
                spread.append(len({g[0] for g in got}))
            running = False
            await asyncio.gather(*bg, return_exceptions=True)
        lat = sorted(r[3] for r in results)
        return {
            "ttl": ttl,
            "policy": policy,
            "hit": sum(r[2] for r in results) / max(1, sum(r[1] for r in results)),
            "mean_s": statistics.fmean(lat),
            "p90_s": lat[int(0.9 * (len(lat) - 1))],
            "pods_per_burst": statistics.fmean(spread),
            "requests": len(results),
        }
    finally:
        await stop_pods(pods)


async def main_async(seconds: float, burst: int, policies: list[str]) -> None:
    rows = [await run(ttl, seconds, burst, p) for p in policies for ttl in (0.0, 2.0)]
    head = ["policy", "routed_ttl_s", "burst hit ratio", "mean (s)", "p90 (s)", "pods per burst"]
    print("| " + " | ".join([*head, "requests"]) + " |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['policy']} | {r['ttl']:g} | {r['hit']:.3f} | {r['mean_s']:.3f} "
            f"| {r['p90_s']:.3f} | {r['pods_per_burst']:.2f} | {r['requests']} |"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--burst", type=int, default=8)
    ap.add_argument("--policies", default="cost,precise_prefix")
    args = ap.parse_args()
    asyncio.run(main_async(args.seconds, args.burst, args.policies.split(",")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
