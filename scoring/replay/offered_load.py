"""Offered load: how much of a fleet's prefill capacity a trace asks for, and rescaling
a trace's arrival times to ask for a chosen share.

Definition (also in docs/replay.md), with the simulated pod's own rates and formulas
(:mod:`scoring.replay.simpod`)::

    work_s  = sum over requests of max(1, P - H) / prefill_rate
    x       = sum over requests of max(0, output - 1) / decode_rate / (pods * span_s)
    D       = x / (1 - decode_batch_slope * x)          # requests decoding on a pod
    offered = work_s * (1 + decode_interference * D) / (pods * span_s)

``P`` is a request's prompt tokens and ``H`` its hit tokens at a *ceiling*: by default
the pooled ceiling of the fleet's total cache (one LRU of ``sum(pod capacities)`` tokens
fed the whole trace, as :func:`scoring.replay.ceilings.pooled_ceiling`), or the infinite
cache (``basis="infinite"``); ``span_s`` runs from the first arrival to the last.  ``D``
is Little's law for the decode batch (a request decodes ``output - 1`` tokens at a step
slowed by ``decode_batch_slope`` per other decoding request), and the prefill engine
slows by ``decode_interference`` per decoding request, as in the pod model.  So
``offered = 1.0`` is the arrival rate at which a router that reached the ceiling would
keep every prefill engine busy all the time; a real policy misses more, so its pods are
busier (the matrix reports ``busy_vs_capacity``, the same ratio measured).  When
``decode_batch_slope * x >= 1`` decode alone saturates the pods and the load is
infinite.  The pooled basis makes "80%" mean the same for a small and a large cache:
80% of what the best routing of *this* fleet could serve.

With the vLLM pod model (:class:`~scoring.replay.vllm_pod.VllmFleetConfig`) the load is
the engine time the trace needs over the engine time the fleet has: prefill at the
engine's prefill rate, decode at its throughput with the largest batch its KV cache
holds, each step's cost from :mod:`scoring.replay.step_cost`, attention included (a
long context costs a step as much as its linear layers do)::

    offered = (work_s + sum(output - 1) / decode_rate) / (pods * span_s)

* ``work_s`` adds, per request, the attention of its uncached tokens to the context
  before them: ``prefill_pair_s * (pairs(H, U) - U * (n + 1) / 2)`` (``U = max(1, P -
  H)``, ``n`` = ``max_num_batched_tokens``), at least 0, on top of ``U / prefill_rate``
  (:meth:`EngineSpec.prefill_rate_tokens_per_s`: one full chunk from an empty context,
  which holds the pairs inside a chunk);
* ``decode_rate = B / (base_s + B * k)`` tokens/s: a step of ``B`` decodes, each costing
  ``k = decode_seq_s + decode_context_token_s * C`` (``C`` the trace's mean decode
  context, over every decoded token: its prompt plus the tokens decoded before it), ``B
  = min(max_num_seqs, pod cache tokens // C)``: running requests pin their blocks, so a
  pod decodes at most as many as its cache holds.

Decodes that ride along in prefill steps advance for free but lengthen those steps;
the sum counts neither.  The prefill-only formula of the simple pod model, with decodes
merely lengthening prefill steps, does not fit an engine whose decodes read long
contexts: a trace of agentic sessions scaled to "80%" by it (attention left out) asked
for about 10x the fleet's compute, the KV reads of its decode steps alone, so every
vLLM-model cell ran deep in overload.

A fleet whose pods differ in speed (``pod_speed``) has the compute of ``sum(speeds)``
pods at speed 1: that sum replaces ``pods`` above.

The ceilings ignore timing, so rescaling every arrival time by ``s`` (about the first)
divides ``work_s / span_s`` and ``x`` by ``s``; :func:`scale_to_load` solves
``offered(s) = target`` (bisection: the load falls as ``s`` grows) and keeps the request
order, the proportions of think times and the size of bursts.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from scoring.replay.ceilings import prefill_at_ceiling
from scoring.replay.simpod import FleetConfig
from scoring.replay.step_cost import prefill_pairs
from scoring.replay.trace import Trace
from scoring.replay.vllm_pod import VllmFleetConfig


def uncached_tokens(trace: Trace, capacity_tokens: int | None) -> int:
    """Prompt tokens still to prefill at a ceiling: the pooled cache of
    ``capacity_tokens`` (``None``: an infinite cache), ``max(1, .)`` per request."""
    return sum(max(1, p - c) for p, c in prefill_at_ceiling(trace, capacity_tokens))


def span_s(trace: Trace) -> float:
    reqs = trace.requests
    return reqs[-1].arrival_s - reqs[0].arrival_s if len(reqs) > 1 else 0.0


@dataclass(frozen=True, slots=True)
class LoadRates:
    """The rates the offered-load formula takes from a pod model."""

    #: the fleet's compute in pods at speed 1 (the pod count unless pods differ in speed)
    pods: float
    total_capacity_tokens: int
    prefill_rate: float
    decode_rate: float
    decode_batch_slope: float
    decode_interference: float
    #: the load is the engine time prefill and decode need, summed (the vLLM model:
    #: ``decode_rate`` is then a pod's decode throughput at its largest batch)
    compute_sum: bool = False


def load_rates(cfg: FleetConfig | VllmFleetConfig, decode_context: float = 0.0) -> LoadRates:
    """The offered-load rates of either pod model (see the module docstring); for the
    vLLM model, of decodes over ``decode_context`` tokens of context on average."""
    if isinstance(cfg, VllmFleetConfig):
        c = cfg.engine.cost
        n = cfg.engine.max_num_batched_tokens
        chunk_s = c.base_s + c.prefill_token_s * n + c.prefill_pair_s * n * (n + 1) / 2
        k = c.decode_seq_s + c.decode_context_token_s * decode_context
        per_pod = cfg.total_capacity_tokens / cfg.pods
        batch = max(1, min(cfg.engine.max_num_seqs, int(per_pod // max(1.0, decode_context))))
        return LoadRates(
            cfg.total_speed,
            cfg.total_capacity_tokens,
            cfg.engine.prefill_rate_tokens_per_s(),
            batch / (c.base_s + batch * k),
            0.0,
            k / chunk_s,
            compute_sum=True,
        )
    return LoadRates(
        cfg.total_speed,
        cfg.total_capacity_tokens,
        cfg.prefill_rate,
        cfg.decode_rate,
        cfg.decode_batch_slope,
        cfg.decode_interference,
    )


def offered_load(
    trace: Trace, cfg: FleetConfig | VllmFleetConfig, *, basis: str = "pooled"
) -> float:
    """The trace's offered prefill load on ``cfg`` (see the module docstring);
    ``basis`` is ``"pooled"`` or ``"infinite"``."""
    work, decode, span, rates = _demand(trace, cfg, basis)
    return _load(work, decode, span, rates)


def scale_to_load(
    trace: Trace, cfg: FleetConfig | VllmFleetConfig, target: float, *, basis: str = "pooled"
) -> tuple[Trace, float]:
    """A copy of ``trace`` with arrival times rescaled about the first arrival so that
    its offered load on ``cfg`` is ``target``; also returns the time scale factor."""
    if not (target > 0 and math.isfinite(target)):
        raise ValueError(f"target load must be > 0, got {target!r}")
    work, decode, span, rates = _demand(trace, cfg, basis)
    lo = work / (rates.pods * span) / target  # the factor if decoding cost nothing
    hi = lo
    while _load(work, decode, span * hi, rates) > target:
        hi *= 2.0
    for _ in range(100):  # load(lo) >= target >= load(hi)
        mid = math.sqrt(lo * hi)
        if _load(work, decode, span * mid, rates) > target:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    factor = hi
    t0 = trace.requests[0].arrival_s
    requests = [
        dataclasses.replace(r, arrival_s=t0 + (r.arrival_s - t0) * factor) for r in trace.requests
    ]
    return dataclasses.replace(trace, requests=requests, errors=list(trace.errors)), factor


def _demand(
    trace: Trace, cfg: FleetConfig | VllmFleetConfig, basis: str
) -> tuple[float, float, float, LoadRates]:
    """``(prefill work s, decode work s, span s, rates)`` of ``trace`` at the ceiling."""
    span = span_s(trace)
    if span <= 0:
        raise ValueError("offered load needs at least two requests at different times")
    decoded = context = 0.0
    for r in trace.requests:
        o = max(0, r.output_tokens - 1)
        decoded += o
        context += o * r.prompt_tokens + o * (o + 1) / 2
    rates = load_rates(cfg, context / decoded if decoded else 0.0)
    prefills = list(prefill_at_ceiling(trace, _capacity(rates, basis)))
    work = sum(max(1, p - c) for p, c in prefills) / rates.prefill_rate
    if isinstance(cfg, VllmFleetConfig):
        work += _context_attention_s(prefills, cfg)
    return work, decoded / rates.decode_rate, span, rates


def _context_attention_s(prefills: list[tuple[int, int]], cfg: VllmFleetConfig) -> float:
    """The prefill attention ``prefill_rate`` leaves out: each request's uncached tokens
    (``prefills``: prompt and cached tokens at the ceiling) attending to the context
    before them, beyond the pairs inside one chunk."""
    e = cfg.engine.cost.prefill_pair_s
    n = cfg.engine.max_num_batched_tokens
    total = 0.0
    for prompt, cached in prefills:
        u = max(1, prompt - cached)
        extra = prefill_pairs(prompt - u, u) - u * (n + 1) / 2
        if extra > 0:
            total += e * extra
    return total


def _load(work_s: float, decode_s: float, span: float, cfg: LoadRates) -> float:
    x = decode_s / (cfg.pods * span)
    if cfg.compute_sum:
        return work_s / (cfg.pods * span) + x
    if cfg.decode_batch_slope * x >= 1.0:
        return math.inf
    decoding = x / (1.0 - cfg.decode_batch_slope * x)
    return work_s * (1.0 + cfg.decode_interference * decoding) / (cfg.pods * span)


def working_set_tokens(trace: Trace) -> int:
    """Tokens in the distinct full blocks of the trace: what an infinite cache holds."""
    distinct: set[int] = set()
    for r in trace.requests:
        distinct.update(r.route.block_keys)
    return len(distinct) * trace.block_size


def _capacity(cfg: LoadRates, basis: str) -> int | None:
    if basis == "pooled":
        return cfg.total_capacity_tokens
    if basis == "infinite":
        return None
    raise ValueError(f"basis must be 'pooled' or 'infinite', got {basis!r}")
