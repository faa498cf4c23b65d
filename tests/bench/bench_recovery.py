"""How long the router's view of a hot prefix stays wrong after each kind of clear.

    python tests/bench/bench_recovery.py [--seconds 12] [--kinds resync,flushall,restart]

4 simulated vLLM pods (in this process: real HTTP, real ZMQ KV events, their own prefix
caches; simulated time at 1x) behind `kvroute serve`'s app (``cost`` policy, in this
process too); 4 hot prompts of ~1,600 tokens; 8 closed-loop clients each send a random
hot prompt plus a short unique question.  After a warm-up, one kind of clear:

* ``resync`` -- the subscriber forgets the pod holding most hot prompts (what a gap its
  replay cannot fill, a queue overflow or an undecodable batch do: ``sink.clear_pod``);
* ``flushall`` -- Redis loses every key (``FLUSHALL``) under a separate `kvroute index`
  and a router replica reading it: every pod is cleared;
* ``restart`` -- the pod's engine restarts (a new sim pod on the same ports, empty cache,
  its KV-event seq from 0).

Then every 100 ms, for each cleared pod and hot prompt, the router's credit
(``POST /v1/route``: >= all but one of the prompt's blocks on that pod, index or
speculative) is compared with the pod's own cache (the ground truth).  Reported, with
``speculative.enabled`` on and off:

* *unplaced until*: the last moment some hot prompt was cached on some pod but credited
  to none of the pods holding it (its next request would miss where a hit was possible);
* *missed until*: the last moment a cleared pod held a hot prompt the router did not
  credit it with (the pod is invisible for that prompt); "> N" = still at the end;
* *false until*: the last moment the router credited a cleared pod with a hot prompt it
  did not hold;
* the hot requests' cache-hit ratio (``usage.prompt_tokens_details.cached_tokens``) in
  the window after the clear, and the share of them sent to the cleared pods.

Only 127.0.0.1.  The Redis-protocol server comes from tests/support/redis_server.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from router.config import Settings
from router.fleet.embedded import start_pods, stop_pods
from router.proxy.app import create_app
from router.proxy.gateway import Gateway
from router.sim.engine import SimRequest
from router.sim.pod import SimPod
from router.sim.settings import SimSettings
from tests.support.redis_server import free_port, start_server, stop_server

MODEL = "sim-model"
BLOCK = 16
PODS = 4
CLIENTS = 8
TOPICS = ["billing disputes", "mortgage rates", "card fraud", "savings accounts"]
HOT = [
    f"You are the bank's assistant for {t}. Policy: " + "be exact and brief. " * 80 for t in TOPICS
]
SAMPLE_S = 0.1


def sims(bind: str) -> list[SimSettings]:
    return [
        SimSettings(
            pod_name=f"sim-{i}",
            model=MODEL,
            block_size=BLOCK,
            port=free_port(),
            kv_endpoint=bind,
            replay_endpoint=f"tcp://127.0.0.1:{free_port()}",
            output_tokens=4,
            decode_rate=200.0,
            prefill_rate=20000.0,
        )
        for i in range(PODS)
    ]


@contextlib.asynccontextmanager
async def serve(settings: Settings) -> AsyncIterator[tuple[Gateway, httpx.AsyncClient]]:
    app = create_app(settings)
    inbox: asyncio.Queue[Any] = asyncio.Queue()
    outbox: asyncio.Queue[Any] = asyncio.Queue()
    scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
    lifespan = asyncio.create_task(app(scope, inbox.get, outbox.put))
    await inbox.put({"type": "lifespan.startup"})
    started = await outbox.get()
    if started["type"] != "lifespan.startup.complete":
        raise RuntimeError(f"the app did not start: {started}")
    transport = httpx.ASGITransport(app=app)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            yield app.state.gateway, client
    finally:
        await inbox.put({"type": "lifespan.shutdown"})
        await outbox.get()
        await lifespan


async def holds(pod: SimPod, ids: list[int]) -> bool:
    """Ground truth: the pod's cache holds all but one block of the prompt."""
    req = pod.engine.prepare(SimRequest(prompt_ids=list(ids), max_tokens=1))
    return pod.engine.cache.match(req.block_hashes) >= len(ids) // BLOCK - 1


async def credited(client: httpx.AsyncClient, prompt: str, blocks: int) -> set[str]:
    """The pods the router credits with the prompt (all but one block, any source)."""
    r = await client.post("/v1/route", json={"model": MODEL, "prompt": prompt})
    return {
        c["pod"]
        for c in r.json()["candidates"]
        if int(c["cached_blocks"].get("GPU", 0)) >= blocks - 1
    }


class Load:
    """CLIENTS closed-loop clients sending hot prompts with unique questions."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self.client = client
        self.rng = random.Random(11)
        self.n = 0
        self.log: list[tuple[float, str, int, int]] = []  # (t, pod, prompt, cached)
        self._tasks: list[asyncio.Task[None]] = []
        self._running = True

    async def _one(self) -> None:
        while self._running:
            self.n += 1
            prompt = self.rng.choice(HOT) + f" Question {self.n}: what now?"
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
            r = await self.client.post("/v1/completions", json=body)
            if r.status_code != 200:
                continue
            u = r.json()["usage"]
            cached = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            self.log.append(
                (time.monotonic(), r.headers["x-kvroute-pod"], u["prompt_tokens"], cached)
            )

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._one()) for _ in range(CLIENTS)]

    async def stop(self) -> None:
        """Let each client finish its request (a cancelled request may end as the
        proxy's 499 for a client gone, not as a cancellation)."""
        self._running = False
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def tokenize(pod: SimPod, prompt: str) -> list[int]:
    async with httpx.AsyncClient() as c:
        r = await c.post(pod.url + "/tokenize", json={"model": MODEL, "prompt": prompt})
    return list(r.json()["tokens"])


def say(msg: str) -> None:
    print(f"# {time.strftime('%H:%M:%S')} {msg}", file=sys.stderr, flush=True)


async def run(kind: str, speculative: bool, seconds: float, workdir: Path) -> dict[str, Any]:
    say(f"{kind}, speculative {'on' if speculative else 'off'}: starting")
    bind_port = free_port()
    bind = f"tcp://127.0.0.1:{bind_port}"
    pod_settings = sims(bind)
    pods = await start_pods(pod_settings)
    redis: Any = None
    indexer: Any = None
    try:
        static = [{"name": p.name, "url": p.url, "models": [MODEL]} for p in pods]
        base: dict[str, Any] = {
            "discovery": {"static": static},
            "fleet": {"enabled": False},
            "scrape": {"interval_s": 0.5},
            "log_level": "warning",
            "speculative": {"enabled": speculative},
            "events": {"mode": "bind", "bind_endpoint": bind},
        }
        if kind == "flushall":
            from router.indexer.main import Indexer

            proc, port = start_server(workdir)
            redis = proc
            url = f"redis://127.0.0.1:{port}/0"
            indexer = Indexer(Settings.model_validate(base), url, metrics_port=0)
            await indexer.start()
            base = {**base, "redis_url": url}  # a replica: reads the index, applies nothing
        settings = Settings.model_validate(base)
        async with serve(settings) as (gateway, client):
            ids = [await tokenize(pods[0], h) for h in HOT]
            blocks = [len(x) // BLOCK for x in ids]
            load = Load(client)
            load.start()
            await asyncio.sleep(6.0)  # warm-up: every hot prompt cached somewhere
            held = [sum([await holds(p, x) for x in ids]) for p in pods]
            target = pods[max(range(PODS), key=held.__getitem__)]
            cleared = list(pods) if kind == "flushall" else [target]
            say(f"clearing {', '.join(p.name for p in cleared)}")
            t0 = time.monotonic()
            if kind == "resync":
                assert gateway.sink is not None
                await gateway.sink.clear_pod(target.name)
            elif kind == "flushall":
                import valkey.asyncio as valkey

                r = valkey.Valkey.from_url(base["redis_url"])
                await r.flushall()
                await r.aclose()
            elif kind == "restart":
                i = pods.index(target)
                await target.stop()
                port = int(target.url.rsplit(":", 1)[1])
                again = pod_settings[i].model_copy(
                    update={"port": port, "replay_endpoint": target.replay_endpoint_url}
                )
                fresh = SimPod(again)
                await fresh.start()
                pods[i] = fresh
                cleared = [fresh]
            say("cleared; sampling")
            missed_until = false_until = unplaced_until = 0.0
            names = {p.name for p in cleared}
            while time.monotonic() - t0 < seconds:
                now = time.monotonic() - t0
                for h, x, b in zip(HOT, ids, blocks, strict=True):
                    credit = await credited(client, h, b)
                    truth = {p.name for p in pods if await holds(p, x)}
                    if truth and not truth & credit:
                        unplaced_until = now + SAMPLE_S
                    if (truth - credit) & names:
                        missed_until = now + SAMPLE_S
                    if (credit - truth) & names:
                        false_until = now + SAMPLE_S
                await asyncio.sleep(SAMPLE_S)
            await load.stop()
            say("done")
            after = [e for e in load.log if e[0] >= t0]
            tokens = sum(e[2] for e in after) or 1
            return {
                "kind": kind,
                "speculative": speculative,
                "missed_until": missed_until,
                "unplaced_until": unplaced_until,
                "false_until": false_until,
                "hit": sum(e[3] for e in after) / tokens,
                "to_cleared": sum(1 for e in after if e[1] in names) / max(1, len(after)),
                "requests": len(after),
                "seconds": seconds,
            }
    finally:
        if indexer is not None:
            await indexer.stop()
        await stop_pods(pods)
        if redis is not None:
            stop_server(redis)


def fmt(t: float, seconds: float) -> str:
    return f"> {seconds:.0f}" if t >= seconds - SAMPLE_S else f"{t:.1f}"


async def main_async(kinds: list[str], seconds: float, keep: bool = False) -> None:
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvroute-recovery-") as tmp:
        print(f"# server logs in {tmp}", file=sys.stderr)
        for kind in kinds:
            for spec in (True, False):
                rows.append(await run(kind, spec, seconds, Path(tmp)))
        if keep:
            for f in Path(tmp).glob("*.log"):
                print(f"--- {f.name}\n" + f.read_text()[-3000:], file=sys.stderr)
    print(
        "| clear | speculative | unplaced until (s) | missed until (s) | false until (s) "
        "| hot hit ratio after | to cleared pods | requests |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        until = " | ".join(
            fmt(r[k], r["seconds"]) for k in ("unplaced_until", "missed_until", "false_until")
        )
        print(
            f"| {r['kind']} | {'on' if r['speculative'] else 'off'} | {until} "
            f"| {r['hit']:.3f} | {r['to_cleared']:.2f} | {r['requests']} |"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--kinds", default="resync,flushall,restart")
    ap.add_argument("--server-logs", action="store_true", help="print the Redis logs")
    args = ap.parse_args()
    asyncio.run(main_async(args.kinds.split(","), args.seconds, args.server_logs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
