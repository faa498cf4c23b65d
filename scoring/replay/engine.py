"""The event loop: one policy, one trace, N simulated pods, in virtual time.

Two pod models (``cfg`` says which): the simple one (:class:`~scoring.replay.simpod.SimPod`,
a :class:`~scoring.replay.simpod.FleetConfig`) and the vLLM-like engine
(:class:`~scoring.replay.vllm_pod.VllmPod`, a
:class:`~scoring.replay.vllm_pod.VllmFleetConfig`).  The router's part is the same for
both (below); only the pods' events differ.

**Arrivals** come from :class:`~scoring.replay.session_loop.Arrivals`: each request at
its trace time (``sessions="open"``), or a session's later turns after the answer to the
turn before (``"closed"``), which an answer's end schedules while pods run.

**Simple pods.**  Events live in a heap ``(time, seq, kind, pod, request)``; arrivals
are merged in, in time order.  At equal times, completions are handled
before arrivals (a pod that finishes at ``t`` is seen free by a request arriving at
``t``).  For each arrival the router's part is played exactly as the live router
plays it::

    views    = [pod.view(request.block_keys) for pod in pods]   # index hits + load
    decision = policy.pick(request, views)
    policy.on_routed(request, decision.pod)    # inflight += 1, outstanding += P
    policy.on_first_token(request, pod, ttft)  # first token: outstanding -= P
    policy.on_finished(request, pod, output)   # last token, then
    policy.on_complete(request, decision.pod)  #              inflight -= 1

The policy's :attr:`~scoring.policies.base.Policy.clock` reads the replay's virtual time
during the replay (restored after), so a policy that learns from observed times sees
the simulated ones, through the same code as live.

**vLLM pods** (the loop is scoring/replay/vllm_loop.py's).  The heap holds each busy
pod's next step end.  When a step ends its first tokens and completions are reported,
then the pod plans its next step at once (vLLM's engine loop), allowed to step over a
decode run only up to the next arrival (with closed sessions, up to the soonest one an
answer could schedule: :meth:`~scoring.replay.session_loop.Arrivals.horizon`), so
every pod's state at an arrival is the state of a real engine at that moment.  A
request arriving at a pod mid-step waits for the next step; at an idle pod it starts
one at its arrival.  A request vLLM would reject (prompt >= ``max_model_len``) is
counted in ``rejected``, has no TTFT, and is completed at once.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable

from scoring.policies.base import Policy
from scoring.replay.run import (
    Job,
    PolicyRun,
    in_order,
    json_first_tokens,
    new_run,
    release_prefilled,
    route_arrival,
)
from scoring.replay.scrapes import Scrapes
from scoring.replay.session_loop import Arrivals
from scoring.replay.simpod import FleetConfig, SimPod
from scoring.replay.trace import Trace
from scoring.replay.vllm_loop import replay_vllm
from scoring.replay.vllm_pod import VllmFleetConfig

__all__ = ["PolicyRun", "json_answers", "replay_policy"]

_PREFILL_DONE = 0
_DECODE_DONE = 1


def replay_policy(
    trace: Trace,
    policy: Policy,
    cfg: FleetConfig | VllmFleetConfig,
    *,
    on_progress: Callable[[int], None] | None = None,
    scrape_interval_s: float = 0.0,
    json_share: float = 0.0,
    json_scrape_s: float | None = None,
    sessions: str = "open",
) -> PolicyRun:
    """Replay ``trace`` through ``policy`` on a fresh fleet described by ``cfg``;
    ``scrape_interval_s`` > 0 shows the policy each pod's scraped fields as a scrape that
    often would (:mod:`scoring.replay.scrapes`), 0 exactly; ``json_share``: the share of
    requests whose clients ask for a JSON answer, not a stream (:func:`json_answers`);
    ``json_scrape_s``: how often their pods' first-token counts are read (None: every
    ``scrape_interval_s``, or 1 s when that is 0; scoring/replay/json_first_tokens.py);
    ``sessions``: "open" (every request at its planned time) or "closed" (a session's
    next turn after its previous answer; scoring/replay/session_loop.py)."""
    wall0 = time.perf_counter()
    cfg.validate()
    json_of = json_answers(len(trace.requests), json_share)
    start = trace.requests[0].arrival_s if trace.requests else 0.0
    scrapes = Scrapes(scrape_interval_s, start)
    if json_scrape_s is not None and not json_scrape_s > 0.0:  # (NaN too)
        raise ValueError(f"json_scrape_s must be > 0, got {json_scrape_s!r}")
    counts_s = json_scrape_s if json_scrape_s is not None else scrape_interval_s
    arrivals = Arrivals(trace.requests, sessions)
    clock = policy.clock
    job = Job(trace, policy, scrapes, json_of, counts_s, arrivals, on_progress)
    try:
        if isinstance(cfg, VllmFleetConfig):
            run = replay_vllm(job, cfg)
        else:
            run = _replay_simple(job, cfg)
    finally:
        policy.clock = clock
    run.json_answer = json_of
    run.arrival_s = list(arrivals.at)
    run.wall_s = time.perf_counter() - wall0
    return run


def json_answers(requests: int, share: float) -> list[bool]:
    """Which of ``requests`` (trace order) ask for a JSON answer: ``share`` of them, spread
    evenly (request ``i`` does when ``floor((i + 1) * share) > floor(i * share)``).

    Live, such a request's first token is never seen: vLLM sends a JSON answer whole, so
    the router's load holds its prompt as outstanding prefill until the answer ends, and
    the policy hears ``on_finished`` / ``on_complete`` but no ``on_first_token``
    (router/proxy/forward.py, router/epp/accounting.py).  The replay plays it so.  Its
    TTFT in the results is still the engine's first token: the policies are compared on
    the same measure whatever the clients ask."""
    if not (0.0 <= share <= 1.0):
        raise ValueError(f"json_share must be within [0, 1], got {share!r}")
    return [math.floor((i + 1) * share) > math.floor(i * share) for i in range(requests)]


def _replay_simple(job: Job, cfg: FleetConfig) -> PolicyRun:
    trace, policy, scrapes, arr = job.trace, job.policy, job.scrapes, job.arrivals
    json_of, counts_s, on_progress = job.json_of, job.counts_s, job.on_progress
    reqs = trace.requests
    pods = [SimPod(f"pod-{i}", cfg, cfg.pod_capacity(i), cfg.speed(i)) for i in range(cfg.pods)]
    index_of = {p.name: i for i, p in enumerate(pods)}
    run = new_run(policy, [p.name for p in pods], reqs)

    heap: list[tuple[float, int, int, int, int]] = []
    seq = 0
    push, pop = heapq.heappush, heapq.heappop
    last_finish = run.first_arrival_s
    bs = cfg.block_size
    now_s = [run.first_arrival_s]
    policy.clock = lambda: now_s[0]
    js = json_first_tokens(json_of, pods, run.first_arrival_s, counts_s)

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
        now_s[0] = now
        pod = pods[pod_i]
        r = reqs[ri]
        if kind == _PREFILL_DONE:
            run.ttft_s[ri] = now - arr.at[ri]
            pod.prefilling = False
            if js is not None:
                js.first_token(pod.name, ri)
            if not json_of[ri]:
                policy.on_first_token(r.route, pod.name, now - arr.at[ri])
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
            if r.answer_keys:
                pod.cache_answer(r.cached_keys())
            last_finish = max(last_finish, now)
            run.e2e_s[ri] = now - arr.at[ri]
            # a JSON answer ends: the router's load sees its prefill done, unless a
            # scrape of the pod's first tokens released it before
            if json_of[ri] if js is None else js.finished(pod.name, ri):
                pod.outstanding -= r.prompt_tokens
            policy.on_finished(r.route, pod.name, r.output_tokens)
            policy.on_complete(r.route, pod.name)
            arr.ended(ri, now)

    def advance(limit: float) -> None:
        """Events (and with JSON answers, scrape instants) up to ``limit`` or the next
        arrival, whichever is first (an answer's end can schedule one), in order."""
        while heap:
            to = min(limit, arr.next_time())
            if js is not None and js.next_at <= heap[0][0] and js.next_at <= to:
                at = now_s[0] = js.next_at
                release_prefilled(js, at, pods, index_of, reqs, policy)
            elif heap[0][0] <= to:
                handle(pop(heap))
            else:
                break
        if js is not None:
            js.skip_to(min(limit, arr.next_time()))

    for k, (ri, t) in enumerate(in_order(arr, advance)):
        r = reqs[ri]
        now_s[0] = t
        pod_i = route_arrival(policy, r, ri, t, scrapes, pods, index_of, run)
        pod = pods[pod_i]
        pod.inflight += 1
        pod.outstanding += r.prompt_tokens
        pod.active_blocks += _blocks(r.prompt_tokens + r.output_tokens, bs)
        pod.queue.append(ri)
        if js is not None:
            js.routed(pod.name, ri)
        start_next(pod_i, t)
        if on_progress is not None:
            on_progress(k)
    advance(math.inf)
    run.busy_s = [p.busy_s for p in pods]
    run.last_finish_s = last_finish
    return run


def _blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)
