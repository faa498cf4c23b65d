"""The event loop: one policy, one trace, N simulated pods, in virtual time.

Events live in a heap ``(time, seq, kind, pod, request)``; arrivals are merged in from
the time-sorted trace.  At equal times, completions are handled before arrivals (a pod
that finishes at ``t`` is seen free by a request arriving at ``t``).  For each arrival the
router's part is played exactly as the live router plays it::

    views    = [pod.view(request.block_keys) for pod in pods]   # index hits + load
    decision = policy.pick(request, views)
    policy.on_routed(request, decision.pod)    # inflight += 1, outstanding += P
    ...                                        # first token: outstanding -= P
    policy.on_complete(request, decision.pod)  # last token:  inflight -= 1
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from scoring.policies.base import Policy
from scoring.replay.simpod import FleetConfig, SimPod
from scoring.replay.trace import Trace

_PREFILL_DONE = 0
_DECODE_DONE = 1


class PolicyError(RuntimeError):
    """The policy chose a pod that is not a candidate."""


@dataclass
class PolicyRun:
    """Raw per-request outcomes of replaying one policy."""

    policy: str
    pods: list[str]
    ttft_s: list[float] = field(default_factory=list)  # per request, trace order
    hit_tokens: list[int] = field(default_factory=list)
    gpu_hit_tokens: list[int] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    pod_of: list[int] = field(default_factory=list)
    busy_s: list[float] = field(default_factory=list)  # per pod: prefill seconds
    first_arrival_s: float = 0.0
    last_finish_s: float = 0.0
    wall_s: float = 0.0


def replay_policy(
    trace: Trace,
    policy: Policy,
    cfg: FleetConfig,
    *,
    on_progress: Callable[[int], None] | None = None,
) -> PolicyRun:
    """Replay ``trace`` through ``policy`` on a fresh fleet described by ``cfg``."""
    import time

    wall0 = time.perf_counter()
    cfg.validate()
    reqs = trace.requests
    n = len(reqs)
    pods = [SimPod(f"pod-{i}", cfg, cfg.pod_capacity(i)) for i in range(cfg.pods)]
    index_of = {p.name: i for i, p in enumerate(pods)}
    run = PolicyRun(policy=policy.name, pods=[p.name for p in pods])
    run.ttft_s = [0.0] * n
    run.hit_tokens = [0] * n
    run.gpu_hit_tokens = [0] * n
    run.prompt_tokens = [r.prompt_tokens for r in reqs]
    run.pod_of = [-1] * n
    run.first_arrival_s = reqs[0].arrival_s if reqs else 0.0

    heap: list[tuple[float, int, int, int, int]] = []
    seq = 0
    push, pop = heapq.heappush, heapq.heappop
    last_finish = run.first_arrival_s
    bs = cfg.block_size

    def start_next(pod_i: int, now: float) -> None:
        nonlocal seq
        pod = pods[pod_i]
        if pod.prefilling or not pod.queue:
            return
        ri = pod.queue.popleft()
        r = reqs[ri]
        duration, gpu_tok, cpu_tok = pod.start_prefill(list(r.route.block_keys), r.prompt_tokens)
        run.hit_tokens[ri] = gpu_tok + cpu_tok
        run.gpu_hit_tokens[ri] = gpu_tok
        seq += 1
        push(heap, (now + duration, seq, _PREFILL_DONE, pod_i, ri))

    def handle(event: tuple[float, int, int, int, int]) -> None:
        nonlocal seq, last_finish
        now, _, kind, pod_i, ri = event
        pod = pods[pod_i]
        r = reqs[ri]
        if kind == _PREFILL_DONE:
            run.ttft_s[ri] = now - r.arrival_s
            pod.prefilling = False
            pod.outstanding -= r.prompt_tokens
            step = pod.decode_step_s()
            pod.decoding += 1
            seq += 1
            push(heap, (now + max(0, r.output_tokens - 1) * step, seq, _DECODE_DONE, pod_i, ri))
            start_next(pod_i, now)
        else:
            pod.decoding -= 1
            pod.inflight -= 1
            pod.active_blocks -= _blocks(r.prompt_tokens + r.output_tokens, bs)
            last_finish = max(last_finish, now)
            policy.on_complete(r.route, pod.name)

    for ri, r in enumerate(reqs):
        t = r.arrival_s
        while heap and heap[0][0] <= t:
            handle(pop(heap))
        keys = list(r.route.block_keys)
        views = [p.view(keys) for p in pods]
        decision = policy.pick(r.route, views)
        pod_i = index_of.get(decision.pod, -1)
        if pod_i < 0:
            raise PolicyError(f"policy {policy.name!r} chose unknown pod {decision.pod!r}")
        pod = pods[pod_i]
        policy.on_routed(r.route, pod.name)
        pod.inflight += 1
        pod.outstanding += r.prompt_tokens
        pod.active_blocks += _blocks(r.prompt_tokens + r.output_tokens, bs)
        pod.queue.append(ri)
        run.pod_of[ri] = pod_i
        start_next(pod_i, t)
        if on_progress is not None:
            on_progress(ri)
    while heap:
        handle(pop(heap))
    run.busy_s = [p.busy_s for p in pods]
    run.last_finish_s = last_finish
    run.wall_s = time.perf_counter() - wall0
    return run


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)
