"""Replay in P/D mode: a prefill pool and a decode pool of simple pods, in virtual time.

The router's part is :class:`scoring.pd.PDRouter` over two lists of views, one per
pool, each pod's view built from its own cache (``SimPod.view``).  Per request:

* **direct** (``PDDecision.split`` false): the decode pod queues it and prefills the
  whole uncached prompt, FCFS, as the simple engine does; the first token comes at the
  end of that prefill.
* **split**: the prefill pod queues it and prefills it (its cache keeps the blocks);
  then the decode pod pulls the blocks it lacks, ``pull_blocks * transfer_s_per_block +
  hop_overhead_s`` later they are in its cache, it queues the request and computes the
  remaining uncached tokens (at least the last one, as vLLM does); the first token the
  client sees comes from the decode pod (the prefill pod's one token is discarded).

Decode is the simple model's (``output - 1`` tokens at the step time fixed when the
request joins the batch).  **ITL** adds the stall that local prefills cause: every
prefill a pod runs while a request decodes there delays that request's tokens by the
prefill's duration (chunked prefill shares the engine steps), so::

    ITL = (decode span + sum of prefill durations started on its pod while it decodes)
          / (output - 1)

(the finish time itself is not pushed back; an approximation, like the simple model's
batch step time).  Not modelled: leases (a prefill pod's blocks are evictable at once),
transfer bandwidth shared between requests, failures.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from scoring.pd import PDDecision, PDParams, PDRouter
from scoring.policies.base import Policy
from scoring.replay.simpod import FleetConfig, SimPod
from scoring.replay.trace import Trace

_P_DONE, _D_ARRIVE, _D_FIRST, _D_DONE = 0, 1, 2, 3


@dataclass
class PDRun:
    """Per-request outcomes of one P/D replay (trace order)."""

    label: str
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)  # nan for single-token outputs
    split: list[bool] = field(default_factory=list)
    hit_tokens: list[int] = field(default_factory=list)  # where the prompt was computed
    prompt_tokens: list[int] = field(default_factory=list)
    wall_s: float = 0.0


def _quantile(xs: Sequence[float], q: float) -> float:
    vals = sorted(x for x in xs if not math.isnan(x))
    if not vals:
        return math.nan
    return vals[min(len(vals) - 1, int(q * len(vals)))]


def summarize_pd(run: PDRun) -> dict[str, float]:
    n = len(run.ttft_s)
    return {
        "requests": float(n),
        "disaggregation_rate": sum(run.split) / n if n else 0.0,
        "hit_rate": sum(run.hit_tokens) / max(1, sum(run.prompt_tokens)),
        "ttft_p50_s": _quantile(run.ttft_s, 0.5),
        "ttft_p90_s": _quantile(run.ttft_s, 0.9),
        "itl_p50_s": _quantile(run.itl_s, 0.5),
        "itl_p90_s": _quantile(run.itl_s, 0.9),
        "wall_s": run.wall_s,
    }


def replay_pd(
    trace: Trace,
    router: PDRouter,
    cfg: FleetConfig,
    prefill_pods: int,
    decode_pods: int,
    label: str = "",
) -> PDRun:
    """Replay ``trace`` through ``router`` on fresh pools of ``cfg``'s simple pods."""
    wall0 = time.perf_counter()
    if prefill_pods < 0 or decode_pods < 1:
        raise ValueError(
            f"need >= 0 prefill pods and >= 1 decode pod, got {prefill_pods}, {decode_pods}"
        )
    cfg.validate()
    reqs = trace.requests
    n = len(reqs)
    pp = [SimPod(f"prefill-{i}", cfg) for i in range(prefill_pods)]
    dp = [SimPod(f"decode-{i}", cfg) for i in range(decode_pods)]
    p_index = {p.name: i for i, p in enumerate(pp)}
    d_index = {p.name: i for i, p in enumerate(dp)}
    run = PDRun(label=label or router.prefill_policy.name)
    run.ttft_s = [math.nan] * n
    run.itl_s = [math.nan] * n
    run.split = [False] * n
    run.hit_tokens = [0] * n
    run.prompt_tokens = [r.prompt_tokens for r in reqs]
    decided: list[PDDecision | None] = [None] * n
    dest = [0] * n  # decode pod index
    stall = [0.0] * decode_pods  # per decode pod: prefill seconds run so far
    stall0 = [0.0] * n
    heap: list[tuple[float, int, int, int, int]] = []
    seq = 0
    bs = cfg.block_size
    params = router.params

    def push(t: float, kind: int, pod_i: int, ri: int) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (t, seq, kind, pod_i, ri))

    def start_prefill_pod(i: int, now: float) -> None:
        pod = pp[i]
        if pod.prefilling or not pod.queue:
            return
        ri = pod.queue.popleft()
        r = reqs[ri]
        duration, gpu, cpu = pod.start_prefill(list(r.route.block_keys), r.prompt_tokens)
        run.hit_tokens[ri] = gpu + cpu
        push(now + duration, _P_DONE, i, ri)

    def start_decode_pod(i: int, now: float) -> None:
        pod = dp[i]
        if pod.prefilling or not pod.queue:
            return
        ri = pod.queue.popleft()
        r = reqs[ri]
        duration, gpu, cpu = pod.start_prefill(list(r.route.block_keys), r.prompt_tokens)
        if not run.split[ri]:
            run.hit_tokens[ri] = gpu + cpu
        stall[i] += duration
        push(now + duration, _D_FIRST, i, ri)

    def handle(ev: tuple[float, int, int, int, int]) -> None:
        now, _, kind, i, ri = ev
        r = reqs[ri]
        keys = list(r.route.block_keys)
        if kind == _P_DONE:
            pod = pp[i]
            pod.prefilling = False
            pod.outstanding -= r.prompt_tokens
            pod.inflight -= 1
            pod.active_blocks -= _blocks(r.prompt_tokens + 1, bs)
            d = decided[ri]
            assert d is not None
            router.on_prefill_complete(r.route, d)
            target = dp[dest[ri]]
            pull = max(0, math.ceil(r.prompt_tokens / bs) - target.cache.match(keys))
            push(
                now + pull * params.transfer_s_per_block + params.hop_overhead_s,
                _D_ARRIVE,
                dest[ri],
                ri,
            )
            start_prefill_pod(i, now)
        elif kind == _D_ARRIVE:
            dp[i].cache.insert(keys)  # the pulled blocks (and the locally held ones)
            dp[i].queue.append(ri)
            start_decode_pod(i, now)
        elif kind == _D_FIRST:
            pod = dp[i]
            pod.prefilling = False
            if not run.split[ri]:
                pod.outstanding -= r.prompt_tokens
            run.ttft_s[ri] = now - r.arrival_s
            step = pod.decode_step_s()
            pod.decoding += 1
            stall0[ri] = stall[i]
            push(now + max(0, r.output_tokens - 1) * step, _D_DONE, i, ri)
            start_decode_pod(i, now)
        else:
            pod = dp[i]
            pod.decoding -= 1
            pod.inflight -= 1
            pod.active_blocks -= _blocks(r.prompt_tokens + r.output_tokens, bs)
            out = r.output_tokens - 1
            if out > 0:
                # stall0 was taken after this request's own prefill was counted
                span = now - (r.arrival_s + run.ttft_s[ri])
                run.itl_s[ri] = (span + stall[i] - stall0[ri]) / out

    for ri, r in enumerate(reqs):
        t = r.arrival_s
        while heap and heap[0][0] <= t:
            handle(heapq.heappop(heap))
        keys = list(r.route.block_keys)
        d = router.pick(r.route, [p.view(keys) for p in pp], [p.view(keys) for p in dp])
        decided[ri] = d
        di = d_index[d.decode_pod]
        dest[ri] = di
        target = dp[di]
        target.inflight += 1
        target.active_blocks += _blocks(r.prompt_tokens + r.output_tokens, bs)
        if d.prefill_pod is None:
            target.outstanding += r.prompt_tokens
            target.queue.append(ri)
            start_decode_pod(di, t)
        else:
            run.split[ri] = True
            router.on_routed(r.route, d)
            pi = p_index[d.prefill_pod]
            pod = pp[pi]
            pod.inflight += 1
            pod.outstanding += r.prompt_tokens
            pod.active_blocks += _blocks(r.prompt_tokens + 1, bs)
            pod.queue.append(ri)
            start_prefill_pod(pi, t)
    while heap:
        handle(heapq.heappop(heap))
    run.wall_s = time.perf_counter() - wall0
    return run


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def replay_pd_policies(
    trace: Trace,
    policies: dict[str, Policy],
    cfg: FleetConfig,
    prefill_pods: int,
    decode_pods: int,
    params: PDParams | None = None,
) -> dict[str, dict[str, float]]:
    """``kvroute replay --prefill-pods N --decode-pods M``: one P/D replay per prefill
    policy (the same decode choice and split rule), summarized."""
    return {
        name: summarize_pd(
            replay_pd(trace, PDRouter(policy, params), cfg, prefill_pods, decode_pods, name)
        )
        for name, policy in policies.items()
    }


def format_pd_table(results: dict[str, dict[str, float]]) -> str:
    rows = [
        f"{'prefill policy':<16} {'split':>6} {'hit':>6} {'TTFT p50':>9} {'TTFT p90':>9} "
        f"{'ITL p50':>9} {'ITL p90':>9}"
    ]
    for name, s in results.items():
        rows.append(
            f"{name:<16} {s['disaggregation_rate']:>6.2f} {s['hit_rate']:>6.3f} "
            f"{s['ttft_p50_s']:>8.3f}s {s['ttft_p90_s']:>8.3f}s "
            f"{s['itl_p50_s'] * 1e3:>7.1f}ms {s['itl_p90_s'] * 1e3:>7.1f}ms"
        )
    return "\n".join(rows)
