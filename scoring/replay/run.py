"""What one replay of a policy records (:class:`PolicyRun`), and the parts of the event
loop both pod models share (scoring/replay/engine.py, scoring/replay/vllm_loop.py):
the router's part of an arrival, arrivals in time order, the JSON answers' scrapes."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from scoring.policies.base import PodView, Policy
from scoring.replay.json_first_tokens import JsonFirstTokens
from scoring.replay.scrapes import Scrapes
from scoring.replay.session_loop import Arrivals
from scoring.replay.simpod import SimPod
from scoring.replay.trace import Trace, TraceRequest
from scoring.replay.vllm_pod import VllmPod


class PolicyError(RuntimeError):
    """The policy chose a pod that is not a candidate."""


@dataclass
class PolicyRun:
    """Raw per-request outcomes of replaying one policy."""

    policy: str
    pods: list[str]
    ttft_s: list[float] = field(default_factory=list)  # per request, trace order
    #: per request: arrival to its last token (what a client of a JSON answer waits);
    #: NaN for a request a pod refused
    e2e_s: list[float] = field(default_factory=list)
    #: per request: whether its client asked for a JSON answer (``json_share``)
    json_answer: list[bool] = field(default_factory=list)
    hit_tokens: list[int] = field(default_factory=list)
    gpu_hit_tokens: list[int] = field(default_factory=list)
    prompt_tokens: list[int] = field(default_factory=list)
    pod_of: list[int] = field(default_factory=list)
    #: per pod: busy seconds (simple: prefilling; vllm: running engine steps)
    busy_s: list[float] = field(default_factory=list)
    first_arrival_s: float = 0.0
    #: per request: when it arrived (its trace time, unless a closed session moved it)
    arrival_s: list[float] = field(default_factory=list)
    last_finish_s: float = 0.0
    wall_s: float = 0.0
    rejected: int = 0  # requests the pods refused (TTFT nan)
    preemptions: int = 0  # vllm: running requests preempted for lack of KV blocks
    #: vllm: the preemptions per pod (empty for the simple pod model, which has none)
    pod_preemptions: list[int] = field(default_factory=list)
    engine_steps: int = 0  # vllm: engine steps run, all pods


@dataclass(frozen=True, slots=True)
class Job:
    """What an event loop replays, whatever the pod model: the trace and the policy,
    the pods' views as the router scrapes them, which answers are JSON and how often
    their pods' first tokens are counted, the arrivals, and who hears the progress."""

    trace: Trace
    policy: Policy
    scrapes: Scrapes
    json_of: Sequence[bool]
    counts_s: float
    arrivals: Arrivals
    on_progress: Callable[[int], None] | None


def new_run(policy: Policy, pods: Sequence[str], reqs: Sequence[TraceRequest]) -> PolicyRun:
    n = len(reqs)
    run = PolicyRun(policy=policy.name, pods=list(pods))
    run.ttft_s = [0.0] * n
    run.e2e_s = [0.0] * n
    run.hit_tokens = [0] * n
    run.gpu_hit_tokens = [0] * n
    run.prompt_tokens = [r.prompt_tokens for r in reqs]
    run.pod_of = [-1] * n
    run.first_arrival_s = reqs[0].arrival_s if reqs else 0.0
    return run


def pick(policy: Policy, r: TraceRequest, views: list[PodView], index_of: dict[str, int]) -> int:
    """The policy's choice for ``r`` (told it was routed there), as a pod index."""
    decision = policy.pick(r.route, views)
    pod_i = index_of.get(decision.pod, -1)
    if pod_i < 0:
        raise PolicyError(f"policy {policy.name!r} chose unknown pod {decision.pod!r}")
    policy.on_routed(r.route, decision.pod)
    return pod_i


def in_order(arr: Arrivals, advance: Callable[[float], None]) -> Iterator[tuple[int, float]]:
    """Each arrival ``(request, time)`` in time order, once the pods' events before it
    are handled (an answer ending meanwhile can schedule an earlier one)."""
    while True:
        advance(math.inf)
        t = arr.next_time()
        if t == math.inf:
            return
        yield arr.pop(), t


def json_first_tokens(
    json_of: Sequence[bool], pods: Sequence[SimPod | VllmPod], start_s: float, every_s: float
) -> JsonFirstTokens | None:
    """The pods' first-token counts the router scrapes, when some answers are JSON."""
    if not any(json_of):
        return None
    return JsonFirstTokens(list(json_of), [p.name for p in pods], start_s, every_s)


def route_arrival(
    policy: Policy,
    r: TraceRequest,
    ri: int,
    t: float,
    scrapes: Scrapes,
    pods: Sequence[SimPod | VllmPod],
    index_of: dict[str, int],
    run: PolicyRun,
) -> int:
    """The router's part of request ``ri`` arriving at ``t``: the policy picks among the
    pods' views (as last scraped) and is told; recorded in ``run``; the pod's index."""
    keys = list(r.route.block_keys)
    pod_i = pick(policy, r, scrapes.views(t, [p.view(keys) for p in pods]), index_of)
    run.pod_of[ri] = pod_i
    return pod_i


def release_prefilled(
    js: JsonFirstTokens,
    at: float,
    pods: Sequence[SimPod | VllmPod],
    index_of: dict[str, int],
    reqs: Sequence[TraceRequest],
    policy: Policy,
) -> None:
    """The scrape at ``at`` shows JSON answers past their prefill: their prompts leave
    their pods' outstanding load, and the policy hears ``on_prefill_done``."""
    for name, ri in js.scrape(at):
        pods[index_of[name]].outstanding -= reqs[ri].prompt_tokens
        policy.on_prefill_done(reqs[ri].route, name)
