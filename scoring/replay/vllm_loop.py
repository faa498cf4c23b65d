"""The event loop of a fleet of vLLM-like pods (scoring/replay/engine.py describes it:
"vLLM pods")."""

from __future__ import annotations

import heapq
import math

from scoring.replay.run import (
    Job,
    PolicyRun,
    in_order,
    json_first_tokens,
    new_run,
    release_prefilled,
    route_arrival,
)
from scoring.replay.vllm_pod import VllmFleetConfig, VllmPod


def replay_vllm(job: Job, cfg: VllmFleetConfig) -> PolicyRun:
    trace, policy, scrapes, arr = job.trace, job.policy, job.scrapes, job.arrivals
    json_of, counts_s, on_progress = job.json_of, job.counts_s, job.on_progress
    reqs = trace.requests
    pods = [VllmPod(f"pod-{i}", cfg, cfg.pod_capacity(i), cfg.speed(i)) for i in range(cfg.pods)]
    index_of = {p.name: i for i, p in enumerate(pods)}
    run = new_run(policy, [p.name for p in pods], reqs)
    overhead = cfg.engine.request_overhead_s  # outside engine steps, added to each TTFT
    heap: list[tuple[float, int, int]] = []  # (step end, seq, pod)
    seq = 0
    push, pop = heapq.heappush, heapq.heappop
    last_finish = run.first_arrival_s
    now_s = [run.first_arrival_s]
    policy.clock = lambda: now_s[0]
    js = json_first_tokens(json_of, pods, run.first_arrival_s, counts_s)

    def start_step(pod_i: int, now: float, horizon: float) -> None:
        nonlocal seq
        plan = pods[pod_i].plan_step(horizon - now)
        if plan is not None:
            seq += 1
            push(heap, (now + plan.duration_s, seq, pod_i))

    def end_step(now: float, pod_i: int) -> None:
        nonlocal last_finish
        pod = pods[pod_i]
        now_s[0] = now
        result = pod.finish_step()
        for s in result.first_tokens:
            r = reqs[s.rid]
            ttft = now - arr.at[s.rid] + overhead
            run.ttft_s[s.rid] = ttft
            if js is not None:
                js.first_token(pod.name, s.rid)
            if not json_of[s.rid]:
                pod.outstanding -= r.prompt_tokens
                policy.on_first_token(r.route, pod.name, ttft)
        for s in result.finished:
            r = reqs[s.rid]
            run.hit_tokens[s.rid] = run.gpu_hit_tokens[s.rid] = s.hit_tokens
            pod.inflight -= 1
            last_finish = max(last_finish, now)
            run.e2e_s[s.rid] = now - arr.at[s.rid] + overhead
            pod.decoded(run.e2e_s[s.rid] - run.ttft_s[s.rid])
            # a JSON answer ends: the router's load sees its prefill done, unless a
            # scrape of the pod's first tokens released it before
            pending = json_of[s.rid] if js is None else js.finished(pod.name, s.rid)
            if pending:
                pod.outstanding -= r.prompt_tokens
            policy.on_finished(r.route, pod.name, s.num_output)
            policy.on_complete(r.route, pod.name)
            arr.ended(s.rid, now + overhead)  # the client has the answer
        start_step(pod_i, now, arr.horizon(now))

    def advance(limit: float) -> None:
        """Step ends (and with JSON answers, scrape instants) up to ``limit`` or the next
        arrival, whichever is first (an answer's end can schedule one), in order."""
        while heap:
            to = min(limit, arr.next_time())
            step_at = heap[0][0]
            if js is not None and js.next_at <= step_at and js.next_at <= to:
                at = now_s[0] = js.next_at
                for p in pods:
                    policy.on_scraped(p.name, p.counters())
                release_prefilled(js, at, pods, index_of, reqs, policy)
            elif step_at <= to:
                end, _, pod_i = pop(heap)
                end_step(end, pod_i)
            else:
                break
        if js is not None:
            js.skip_to(min(limit, arr.next_time()))

    for k, (ri, t) in enumerate(in_order(arr, advance)):
        r = reqs[ri]
        now_s[0] = t
        pod_i = route_arrival(policy, r, ri, t, scrapes, pods, index_of, run)
        pod = pods[pod_i]
        if pod.admit(ri, r) is None:
            run.rejected += 1
            run.ttft_s[ri] = run.e2e_s[ri] = math.nan
            policy.on_complete(r.route, pod.name)
            arr.ended(ri, t)
        else:
            pod.inflight += 1
            pod.outstanding += r.prompt_tokens
            if js is not None:
                js.routed(pod.name, ri)
            if not pod.stepping:
                start_step(pod_i, t, arr.horizon(t))
        if on_progress is not None:
            on_progress(k)
    advance(math.inf)
    run.busy_s = [p.busy_s for p in pods]
    run.last_finish_s = last_finish
    run.pod_preemptions = [p.sched.preemptions for p in pods]
    run.preemptions = sum(run.pod_preemptions)
    run.engine_steps = sum(p.sched.steps for p in pods)
    return run
