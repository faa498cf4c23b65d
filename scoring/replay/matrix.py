"""The benchmark matrix: every policy on workloads x fleets x cache sizes x offered loads.

A :class:`Cell` is one workload on one fleet at one cache size and one offered load; a
cell is replayed once per seed, every policy on the same scaled trace.  Dimensions:

* **workload** — the synthetic families (:mod:`scoring.replay.families`: ``agentic``,
  ``rag``, ``rag_bursty`` = RAG with on-off bursts, ``chat``, ``mixed``) for the seed,
  and the two Mooncake traces in ``../shared/traces/`` (the same for every seed).
* **fleet** — 4, 8 or 16 pods, ``equal``, ``unequal`` or ``mixed``.  ``unequal``: half
  the pods hold twice the cache of the other half (80 GB next to 40 GB GPUs), same
  total.  ``mixed``: the same caches, and the pods with the larger cache are also twice
  as fast (a newer GPU next to an older one); speeds 4/3 and 2/3, so the fleet's compute
  is that of the equal fleet.
* **cache** — the fleet's total cache as a share of the trace's working set (its distinct
  full blocks, what an infinite cache would hold): ``small`` 10%, ``medium`` 30%,
  ``large`` 100%.  No pod holds less than the longest prompt (vLLM will not serve a
  prompt longer than its KV cache).
* **load** — arrival times rescaled so the offered prefill work is 50%, 80% or 110% of
  the fleet's prefill capacity at the pooled ceiling (:mod:`scoring.replay.offered_load`).

Per cell and policy: hit rate and hit rate / pooled ceiling, TTFT p50 / p90 / p99 in
seconds and relative to the best policy *in that cell* (the best is 1.00), imbalance
(max / mean per-pod busy time).  :func:`scoring.replay.matrix_summary.summarize` aggregates
per policy and seed group:
geometric mean of TTFT p90 / best across cells, cells within 1.05x of the best, the
worst ratio and its cell.  The first seed is the *tuning* seed, the others are
*held out*: a policy's constants may be chosen looking at the first, never at the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from scoring.policies.registry import available_policies, build_policy, policy_class
from scoring.replay.ceilings import infinite_ceiling, pooled_ceiling
from scoring.replay.engine import PolicyRun, replay_policy
from scoring.replay.fleet_args import fleet_defaults

# (the matrix's dimensions, cells and fleets; imported from here by name too)
from scoring.replay.matrix_cells import (
    CACHE_FRACTIONS,
    FLEET_KINDS,
    FLEET_SIZES,
    LOADS,
    MATRIX_SESSIONS,
    MOONCAKE,
    POD_MODELS,
    SYNTHETIC,
    TRACES_DIR,
    UNEQUAL_WEIGHTS,
    VLLM_PRESET,
    WORKLOADS,
    Cell,
    fleet_for,
    full_matrix,
    load_workload,
    matrix_preset,
    matrix_presets,
    pod_fleet,
    quick_matrix,
    select,
)
from scoring.replay.offered_load import load_rates, scale_to_load, span_s, working_set_tokens
from scoring.replay.report import summarize as summarize_run
from scoring.replay.simpod import FleetConfig, ReplayConfigError
from scoring.replay.trace import Trace
from scoring.replay.vllm_pod import VllmFleetConfig

__all__ = [
    "CACHE_FRACTIONS",
    "FLEET_KINDS",
    "FLEET_SIZES",
    "LOADS",
    "MATRIX_SESSIONS",
    "MOONCAKE",
    "POD_MODELS",
    "SYNTHETIC",
    "TRACES_DIR",
    "UNEQUAL_WEIGHTS",
    "VLLM_PRESET",
    "WORKLOADS",
    "Cell",
    "add_ratios",
    "cell_replay_input",
    "fleet_for",
    "full_matrix",
    "load_workload",
    "matrix_preset",
    "matrix_presets",
    "parse_variant",
    "pod_fleet",
    "quick_matrix",
    "run_cell",
    "run_matrix",
    "select",
]


# --- one cell -----------------------------------------------------------------------


def cell_replay_input(
    cell: Cell,
    seed: int,
    *,
    limit: int | None = None,
    block_size: int = 64,
    traces_dir: str | Path = TRACES_DIR,
    pod_model: str = "simpod",
    preset: str = VLLM_PRESET,
) -> tuple[Trace, FleetConfig | VllmFleetConfig, float]:
    """What :func:`run_cell` replays on ``cell`` for ``seed``: the workload's trace scaled
    to the cell's offered load, the fleet in ``pod_model`` (``vllm``: engines of
    ``preset``), and the time scale applied."""
    trace = load_workload(
        cell.workload, seed, limit=limit, block_size=block_size, traces_dir=str(traces_dir)
    )
    cfg = pod_fleet(fleet_for(cell, trace), pod_model, preset)
    scaled, factor = scale_to_load(trace, cfg, cell.load)
    return scaled, cfg, factor


def _replay(
    trace: Trace,
    name: str,
    cfg: FleetConfig | VllmFleetConfig,
    params: Mapping[str, Any] | None = None,
    json_share: float = 0.0,
    json_scrape_s: float | None = None,
    sessions: str = "open",
) -> PolicyRun:
    policy = build_policy(name, {**fleet_defaults(name, cfg), **(params or {})})
    return replay_policy(
        trace,
        policy,
        cfg,
        json_share=json_share,
        json_scrape_s=json_scrape_s,
        sessions=sessions,
    )


def parse_variant(spec: str) -> tuple[str, str, dict[str, Any]]:
    """``LABEL=POLICY:KEY=VALUE,KEY=VALUE`` (values YAML) -> (label, policy, params): a
    registered policy under other parameters, reported as its own row ``LABEL``."""
    import yaml

    label, sep, rest = spec.partition("=")
    policy, _, items = rest.partition(":")
    if not sep or not label or not policy or ":" in label:
        raise ReplayConfigError(f"variant {spec!r}: expected LABEL=POLICY:KEY=VALUE,...")
    if label in available_policies():
        raise ReplayConfigError(f"variant {spec!r}: label {label!r} is a policy's name")
    params: dict[str, Any] = {}
    for item in filter(None, items.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ReplayConfigError(f"variant {spec!r}: {item!r} is not KEY=VALUE")
        params[key.strip()] = yaml.safe_load(value)
    build_policy(policy, params)  # a bad name or parameter fails here, before any cell
    return label, policy, params


def run_cell(
    cell: Cell,
    seed: int,
    *,
    policies: Sequence[str] | None = None,
    limit: int | None = None,
    block_size: int = 64,
    traces_dir: str | Path = TRACES_DIR,
    pod_model: str = "simpod",
    variants: Sequence[str] = (),
    json_share: float = 0.0,
    tie_seed: int = 0,
    json_scrape_s: float | None = None,
    sessions: str = MATRIX_SESSIONS,
    preset: str = VLLM_PRESET,
) -> dict[str, Any]:
    """Replay every policy (default: every registered one) and every variant
    (:func:`parse_variant`) on ``cell`` for ``seed``; ``json_share`` of the requests
    ask for JSON answers forwarded as they came
    (:func:`scoring.replay.engine.json_answers`), their pods' first-token counts read
    every ``json_scrape_s`` (None: 1 s, the live default).  ``tie_seed`` is the ``seed`` of
    every policy that breaks ties with one (a variant that sets its own keeps it): which
    of two pods a policy scores equal gets a request, drawn again, so that a cell's
    spread over tie seeds is its noise (:mod:`scoring.replay.matrix_ties`).  ``sessions``:
    "closed" sends a session's next turn after its previous answer
    (:mod:`scoring.replay.session_loop`), "open" at its planned time.  ``preset``: the
    vLLM pod model's engine (:func:`matrix_preset`; the simple pod model has none)."""
    import time

    wall0 = time.perf_counter()
    scaled, cfg, factor = cell_replay_input(
        cell,
        seed,
        limit=limit,
        block_size=block_size,
        traces_dir=traces_dir,
        pod_model=pod_model,
        preset=preset,
    )
    pooled = pooled_ceiling(scaled, cfg.total_capacity_tokens)
    speeds = [cfg.speed(i) for i in range(cfg.pods)]
    out: dict[str, Any] = {
        "cell": cell.id,
        "dims": asdict(cell),
        "seed": seed,
        "requests": len(scaled.requests),
        "block_size": scaled.block_size,
        "working_set_tokens": working_set_tokens(scaled),
        "fleet": {
            "pods": cfg.pods,
            "pod_capacity_tokens": [cfg.pod_capacity(i) for i in range(cfg.pods)],
            "pod_speed": speeds,
            "prefill_rate": load_rates(cfg).prefill_rate,
            "pod_model": pod_model,
            **({"preset": preset} if pod_model == "vllm" else {}),
        },
        "offered_load": cell.load,
        "json_share": json_share,
        **({"json_scrape_s": json_scrape_s} if json_scrape_s is not None else {}),
        "sessions": sessions,  # (absent from runs before session 37: open)
        "time_scale": factor,
        "ceilings": {"infinite": infinite_ceiling(scaled), "pooled": pooled},
        "policies": {},
    }
    capacity_s = cfg.total_speed * max(span_s(scaled), 1e-9)
    runs: list[tuple[str, str, dict[str, Any]]] = [
        (name, name, {}) for name in (policies or available_policies())
    ]
    runs += [parse_variant(v) for v in variants]
    if tie_seed:
        runs = [
            (n, pol, {**kw, "seed": tie_seed})
            if "seed" not in kw and "seed" in policy_class(pol).Params.model_fields
            else (n, pol, kw)
            for n, pol, kw in runs
        ]
        out["tie_seed"] = tie_seed
    for name, policy, params in runs:
        run = _replay(scaled, policy, cfg, params, json_share, json_scrape_s, sessions)
        m = summarize_run(run)
        out["policies"][name] = {
            "hit_rate": m["hit_rate"],
            "of_pooled": m["hit_rate"] / pooled if pooled > 0 else None,
            "ttft_p50_s": m["ttft_p50_s"],
            "ttft_p90_s": m["ttft_p90_s"],
            "ttft_p99_s": m["ttft_p99_s"],
            # arrival to last token: what a client of a JSON answer waits (all requests,
            # and those asking for one with --json-share; None without)
            "e2e_p90_s": m["e2e_p90_s"],
            "json_e2e_p90_s": m["json_e2e_p90_s"],
            "imbalance": m["imbalance"],
            # prefill busy time / capacity over the arrival span: the load this policy
            # actually put on the fleet, comparable to offered_load
            # (busy seconds at each pod's speed: work in seconds of a speed-1 pod)
            "busy_vs_capacity": sum(b * v for b, v in zip(run.busy_s, speeds, strict=True))
            / capacity_s,
            "mean_utilisation": m["mean_utilisation"],
            "replay_wall_s": m["replay_wall_s"],
            # running requests vLLM pods preempted for lack of KV blocks (0 for simpod)
            "preemptions": m["preemptions"],
        }
    add_ratios(out)
    out["wall_s"] = time.perf_counter() - wall0
    return out


def add_ratios(cell_result: dict[str, Any]) -> None:
    """Each policy's TTFT percentiles over the cell's best (lowest) for that percentile,
    and its end-to-end p90 over the best one (``e2e_p90_vs_best``) where every policy
    has one (a run from before session 28 has none)."""
    pols = cell_result["policies"]
    keys = [(f"ttft_{q}_s", f"{q}_vs_best") for q in ("p50", "p90", "p99")]
    if all(m.get("e2e_p90_s") is not None for m in pols.values()):
        keys.append(("e2e_p90_s", "e2e_p90_vs_best"))
    for key, ratio in keys:
        best = min(m[key] for m in pols.values())
        for m in pols.values():
            m[ratio] = m[key] / best if best > 0 else 1.0


# --- the whole matrix ---------------------------------------------------------------


def run_matrix(
    cells: Sequence[Cell],
    seeds: Sequence[int],
    *,
    jobs: int = 1,
    on_result: Callable[[dict[str, Any]], None] | None = None,
    **kw: Any,
) -> list[dict[str, Any]]:
    """Every cell for every seed, ``jobs`` processes; results in (cell, seed) order.

    A Mooncake cell is the same for every seed: it is replayed for the first seed and
    its result repeated for the others (marked ``"same_as_seed"``)."""
    every = [(cell, seed) for cell in sorted(cells) for seed in seeds]
    tasks = [(c, s) for c, s in every if c.workload not in MOONCAKE or s == seeds[0]]
    results: list[dict[str, Any]] = []
    if jobs <= 1:
        for cell, seed in tasks:
            results.append(run_cell(cell, seed, **kw))
            if on_result is not None:
                on_result(results[-1])
    else:
        import multiprocessing as mp
        from functools import partial

        with mp.get_context("fork").Pool(jobs) as pool:
            for r in pool.imap_unordered(partial(_run_task, kw=kw), tasks):
                results.append(r)
                if on_result is not None:
                    on_result(r)
    done = {(r["cell"], r["seed"]): r for r in results}
    out: list[dict[str, Any]] = []
    for cell, seed in every:
        got = done.get((cell.id, seed))
        if got is None:
            got = {**done[(cell.id, seeds[0])], "seed": seed, "same_as_seed": seeds[0]}
        out.append(got)
    return out


def _run_task(task: tuple[Cell, int], kw: dict[str, Any]) -> dict[str, Any]:
    return run_cell(task[0], task[1], **kw)
