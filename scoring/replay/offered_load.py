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

With the vLLM pod model (:class:`~scoring.replay.vllm_pod.VllmFleetConfig`) the same
formula takes the engine preset's rates (:func:`load_rates`): ``prefill_rate`` =
:meth:`EngineSpec.prefill_rate_tokens_per_s` (one full chunk from an empty context),
``decode_rate`` = one lone decode step's inverse, ``1 / (base_s + decode_seq_s)``,
``decode_batch_slope`` = ``decode_seq_s / (base_s + decode_seq_s)`` (each extra sequence
adds its linear-layer cost to the step; attention over context is left out), and
``decode_interference`` = :meth:`EngineSpec.decode_slowdown_per_running`.

The ceilings ignore timing, so rescaling every arrival time by ``s`` (about the first)
divides ``work_s / span_s`` and ``x`` by ``s``; :func:`scale_to_load` solves
``offered(s) = target`` (bisection: the load falls as ``s`` grows) and keeps the request
order, the proportions of think times and the size of bursts.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from scoring.replay.simpod import FleetConfig
from scoring.replay.trace import Trace, TraceRequest
from scoring.replay.vllm_pod import VllmFleetConfig
from scoring.simcache import PrefixCache


def uncached_tokens(trace: Trace, capacity_tokens: int | None) -> int:
    """Prompt tokens still to prefill at a ceiling: the pooled cache of
    ``capacity_tokens`` (``None``: an infinite cache), ``max(1, .)`` per request."""
    bs = trace.block_size
    total = 0
    if capacity_tokens is None:
        seen: set[int] = set()
        for r in trace.requests:
            keys = r.route.block_keys
            n = 0
            for k in keys:
                if k not in seen:
                    break
                n += 1
            total += max(1, r.prompt_tokens - min(n * bs, r.prompt_tokens))
            seen.update(keys)
        return total
    cache = PrefixCache(capacity_tokens // bs)
    for r in trace.requests:
        keys = r.route.block_keys
        total += max(1, r.prompt_tokens - min(cache.match(keys) * bs, r.prompt_tokens))
        cache.insert(keys)
    return total


def span_s(trace: Trace) -> float:
    reqs = trace.requests
    return reqs[-1].arrival_s - reqs[0].arrival_s if len(reqs) > 1 else 0.0


@dataclass(frozen=True, slots=True)
class LoadRates:
    """The rates the offered-load formula takes from a pod model."""

    pods: int
    total_capacity_tokens: int
    prefill_rate: float
    decode_rate: float
    decode_batch_slope: float
    decode_interference: float


def load_rates(cfg: FleetConfig | VllmFleetConfig) -> LoadRates:
    """The offered-load rates of either pod model (see the module docstring)."""
    if isinstance(cfg, VllmFleetConfig):
        c = cfg.engine.cost
        lone = c.base_s + c.decode_seq_s
        return LoadRates(
            cfg.pods,
            cfg.total_capacity_tokens,
            cfg.engine.prefill_rate_tokens_per_s(),
            1.0 / lone,
            c.decode_seq_s / lone,
            cfg.engine.decode_slowdown_per_running(),
        )
    return LoadRates(
        cfg.pods,
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
    rates = load_rates(cfg)
    work, decode, span = _demand(trace, rates, basis)
    return _load(work, decode, span, rates)


def scale_to_load(
    trace: Trace, cfg: FleetConfig | VllmFleetConfig, target: float, *, basis: str = "pooled"
) -> tuple[Trace, float]:
    """A copy of ``trace`` with arrival times rescaled about the first arrival so that
    its offered load on ``cfg`` is ``target``; also returns the time scale factor."""
    if not (target > 0 and math.isfinite(target)):
        raise ValueError(f"target load must be > 0, got {target!r}")
    rates = load_rates(cfg)
    work, decode, span = _demand(trace, rates, basis)
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
        TraceRequest(
            arrival_s=t0 + (r.arrival_s - t0) * factor,
            output_tokens=r.output_tokens,
            route=r.route,
            turns=r.turns,
        )
        for r in trace.requests
    ]
    return dataclasses.replace(trace, requests=requests, errors=list(trace.errors)), factor


def _demand(trace: Trace, cfg: LoadRates, basis: str) -> tuple[float, float, float]:
    """``(prefill work s, decode work s, span s)`` of ``trace`` at the ceiling."""
    span = span_s(trace)
    if span <= 0:
        raise ValueError("offered load needs at least two requests at different times")
    work = uncached_tokens(trace, _capacity(cfg, basis)) / cfg.prefill_rate
    decode = sum(max(0, r.output_tokens - 1) for r in trace.requests) / cfg.decode_rate
    return work, decode, span


def _load(work_s: float, decode_s: float, span: float, cfg: LoadRates) -> float:
    x = decode_s / (cfg.pods * span)
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
