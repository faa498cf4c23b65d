"""Routing quality matrix: every registered policy on workloads x fleets x caches x loads.

    python tests/bench/bench_quality_matrix.py --quick --out /tmp/matrix
    python tests/bench/bench_quality_matrix.py --jobs 2 --seed 0 --seed 1 --seed 2 --out /tmp/full
    python tests/bench/bench_quality_matrix.py --cells 'agentic/*' --cells '*/p16-*/*/load110'
    python tests/bench/bench_quality_matrix.py --merge /tmp/peers.json --merge /tmp/mine.json \
        --seed 0 --seed 1 --seed 2 --targets measured --out /tmp/both
    python tests/bench/bench_quality_matrix.py --quick --pod-model vllm --tie-seeds 3 --out /tmp/t

Runs :func:`scoring.replay.matrix.run_matrix` (see that module for the dimensions and
metrics) and writes ``OUT.md`` (the summary, then one row per cell, seed and policy) and
``OUT.json`` (everything, with the seeds and the command); the summary is also printed.
The first ``--seed`` is the tuning seed, the others are held out: compare a policy's
summary columns for the two groups before believing a constant.  The Mooncake traces
(``--traces``, default ``../shared/traces/`` next to the repo) are the same for every
seed.  Policies are whatever the registry holds (``--policy`` to pick some).
Sessions (the ``agentic`` and ``chat`` families) replay closed, each turn after the
answer to the one before (``--sessions``); until session 37 the matrix replayed them
open, so a figure recorded before session 38 reproduces with ``--sessions open``.
``--merge`` (repeatable) replays nothing: it joins earlier runs' ``OUT.json`` cell by
cell (the policies of the same cell and seed side by side, a later file winning for a
policy in both; the replay is in virtual time, so a policy's numbers do not depend on
the run it came from), recomputes the ratios to each cell's best, the summary and the
targets.  It refuses cells whose traces differ or whose policy sets end up different.
``--tie-seeds K`` replays the whole run K times, every policy that breaks ties with a
seed drawing them with seeds 0..K-1, and adds the targets under each draw, the cells
whose verdict holds under every draw, and each cell's p90 band
(:mod:`scoring.replay.matrix_ties`).  ``--merge`` joins such runs draw by draw, and
refuses runs drawn under different tie seeds.  ``--leave-out POLICY`` (repeatable) drops
a row from what ``--targets`` is compared with: ``--targets arr --leave-out cost`` judges
a variant of ``cost`` against the peers alone.

Cost, on the 2 shared cores: ``--quick`` (14 cells, 8 policies, the simple pod model)
about 2 minutes, the full matrix (378 cells) an estimated 40 minutes with ``--jobs 2``
(docs/replay.md); with ``--pod-model vllm`` and every policy, ``--quick --jobs 2`` took
7-9 minutes in session 33 (seeds 127 and 139), and ``--tie-seeds K`` K times as long.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from scoring.policies.registry import available_policies
from scoring.replay.matrix import (
    FLEET_SIZES,
    MATRIX_SESSIONS,
    MOONCAKE,
    POD_MODELS,
    TRACES_DIR,
    VLLM_PRESET,
    full_matrix,
    matrix_presets,
    parse_variant,
    quick_matrix,
    run_matrix,
    select,
)
from scoring.replay.matrix_merge import merge_runs, merge_ties, same_setup
from scoring.replay.matrix_report import markdown, summary_table
from scoring.replay.matrix_summary import summarize
from scoring.replay.matrix_targets import leave_out, targets, targets_table
from scoring.replay.matrix_ties import ties_table
from scoring.replay.session_loop import SESSION_MODES


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the small matrix (14 cells)")
    ap.add_argument(
        "--cells",
        action="append",
        default=[],
        metavar="GLOB",
        help="keep cells whose id matches (repeatable), e.g. 'rag*/p8-*/*/load80'",
    )
    ap.add_argument(
        "--seed",
        action="append",
        type=int,
        default=None,
        help="repeatable; the first is the tuning seed, the rest are held out (default 0)",
    )
    ap.add_argument("--jobs", type=int, default=1, help="processes over cells (default 1)")
    ap.add_argument("--limit", type=int, default=None, help="first N requests of each trace")
    ap.add_argument("--policy", action="append", choices=available_policies(), default=None)
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL=POLICY:K=V,...",
        help="also run POLICY with these parameters as row LABEL (repeatable), e.g. "
        "'cost_req=cost:backlog_unit=request'",
    )
    ap.add_argument("--block-size", type=int, default=16, help="synthetic families (default 16)")
    ap.add_argument("--traces", type=Path, default=TRACES_DIR, help="dir of the Mooncake traces")
    ap.add_argument("--pod-model", choices=POD_MODELS, default=POD_MODELS[0])
    ap.add_argument(
        "--preset",
        choices=matrix_presets(),
        default=VLLM_PRESET,
        help=f"the vLLM pod model's engine (default {VLLM_PRESET}); the caches stay sized "
        "to each cell's working set",
    )
    ap.add_argument("--out", type=Path, help="write OUT.md and OUT.json")
    ap.add_argument("--list", action="store_true", help="print the selected cell ids and exit")
    ap.add_argument(
        "--targets",
        metavar="POLICY",
        default="cost",
        help="print issue #9's targets for POLICY (default cost; skipped if not in the run)",
    )
    ap.add_argument(
        "--leave-out",
        action="append",
        default=[],
        metavar="POLICY",
        help="leave POLICY out of what --targets is compared with (repeatable), e.g. "
        "'--targets arr --leave-out cost' judges a variant of cost against the peers alone",
    )
    ap.add_argument(
        "--merge",
        action="append",
        type=Path,
        default=[],
        metavar="FILE",
        help="no replay: join earlier runs' OUT.json (repeatable; --seed orders the seeds)",
    )
    ap.add_argument(
        "--json-share",
        type=float,
        default=0.0,
        help="share of requests asking for JSON answers forwarded as they came: no first "
        "token seen, prefill load held to the end (kvroute replay --json-share)",
    )
    ap.add_argument(
        "--json-scrape-s",
        type=float,
        default=None,
        metavar="S",
        help="with --json-share: read the pods' first-token counts every S seconds "
        "(default 1, kvroute serve's scrape.interval_s)",
    )
    ap.add_argument(
        "--tie-seeds",
        type=int,
        default=1,
        metavar="K",
        help="replay the matrix under tie seeds 0..K-1 (every policy's tie-break seed) and "
        "report each cell's spread and --targets' verdict under each (default 1: seed 0 only)",
    )
    ap.add_argument(
        "--fleet-sizes",
        type=int,
        nargs="+",
        metavar="N",
        help="the full matrix's fleet sizes in pods (default 4 8 16); other sizes are "
        "held out: no default was ever looked at on them (2 <= N <= 64; not with --quick)",
    )
    ap.add_argument(
        "--sessions",
        choices=SESSION_MODES,
        default=MATRIX_SESSIONS,
        help="closed (the default since session 38): a session's next turn its planned gap "
        "after its previous answer ends, as an agent or a chat client sends it "
        "(scoring/replay/session_loop.py); open: every request at its planned time, "
        "whatever the fleet does (the matrix's mode until session 37)",
    )
    ap.add_argument(
        "--from-json",
        type=Path,
        metavar="FILE",
        help="no replay: print the summary and targets of an earlier run's OUT.json",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = build_parser().parse_args(argv)
    if a.from_json is not None:
        old = json.loads(a.from_json.read_text())
        print(summary_table(old["summary"]))
        print_targets(old["cells"], old["run"]["seeds"], a.targets, a.leave_out)
        print_ties(old, a.targets, a.leave_out)
        return 0
    seeds: list[int] = a.seed or [0]
    if len(set(seeds)) != len(seeds):
        print("bench_quality_matrix: --seed values must differ", file=sys.stderr)
        return 2
    if a.merge:
        return merge_main(a, argv)
    if a.jobs < 1 or (a.limit is not None and a.limit < 2) or a.block_size < 1 or a.tie_seeds < 1:
        print(
            "bench_quality_matrix: --jobs >= 1, --limit >= 2, --block-size >= 1, --tie-seeds >= 1",
            file=sys.stderr,
        )
        return 2
    if a.json_scrape_s is not None and not a.json_scrape_s > 0.0:
        print(
            f"bench_quality_matrix: --json-scrape-s must be > 0, got {a.json_scrape_s}",
            file=sys.stderr,
        )
        return 2
    if not 0.0 <= a.json_share <= 1.0:
        print(
            f"bench_quality_matrix: --json-share must be within [0, 1], got {a.json_share}",
            file=sys.stderr,
        )
        return 2
    if a.fleet_sizes is not None and (a.quick or not all(2 <= n <= 64 for n in a.fleet_sizes)):
        print(
            f"bench_quality_matrix: --fleet-sizes takes pod counts within [2, 64], not with "
            f"--quick; got {a.fleet_sizes}",
            file=sys.stderr,
        )
        return 2
    sizes = FLEET_SIZES if a.fleet_sizes is None else tuple(a.fleet_sizes)
    cells = select(quick_matrix() if a.quick else full_matrix(sizes), a.cells)
    if a.list:
        print("\n".join(c.id for c in cells))
        return 0
    if not cells:
        print(f"bench_quality_matrix: no cell matches {a.cells}", file=sys.stderr)
        return 2
    missing = sorted(
        {str(a.traces / MOONCAKE[c.workload]) for c in cells if c.workload in MOONCAKE}
        - {str(p) for p in a.traces.glob("*.jsonl")}
    )
    if missing:
        # checked before the first cell: a run of hours must not stop at its first Mooncake cell
        print(
            f"bench_quality_matrix: Mooncake trace not found: {missing[0]} "
            "(pass --traces DIR; the default is ../shared/traces next to the checkout)",
            file=sys.stderr,
        )
        return 2
    policies = a.policy or available_policies()
    try:
        labels = [parse_variant(v)[0] for v in a.variant]
    except ValueError as exc:  # ReplayConfigError, PolicyConfigError
        print(f"bench_quality_matrix: {exc}", file=sys.stderr)
        return 2
    # a Mooncake cell is replayed once, for the first seed (run_matrix)
    total = a.tie_seeds * sum(
        1 for c in cells for s in seeds if c.workload not in MOONCAKE or s == seeds[0]
    )
    done = 0
    wall0 = time.perf_counter()

    def progress(r: dict[str, Any]) -> None:
        nonlocal done
        done += 1
        print(
            f"[{done}/{total}] {r['cell']} seed {r['seed']}: {r['requests']:,} requests, "
            f"{r['wall_s']:.1f} s",
            file=sys.stderr,
            flush=True,
        )

    runs = {
        tie: run_matrix(
            cells,
            seeds,
            jobs=a.jobs,
            on_result=progress,
            policies=policies,
            limit=a.limit,
            block_size=a.block_size,
            traces_dir=a.traces,
            pod_model=a.pod_model,
            preset=a.preset,
            variants=a.variant,
            json_share=a.json_share,
            json_scrape_s=a.json_scrape_s,
            tie_seed=tie,
            sessions=a.sessions,
        )
        for tie in range(a.tie_seeds)
    }
    results = runs[0]
    wall_s = time.perf_counter() - wall0
    doc = report(
        argv,
        seeds,
        results,
        policies=[*policies, *labels],
        block_size=a.block_size,
        limit=a.limit,
        pod_model=a.pod_model,
        **({"preset": a.preset} if a.pod_model == "vllm" else {}),
        json_share=a.json_share,
        sessions=a.sessions,
        jobs=a.jobs,
        wall_s=wall_s,
        tie_seeds=a.tie_seeds,
    )
    if a.tie_seeds > 1:  # tie seed 0 is "cells", as in a run without ties
        doc["ties"] = {str(tie): runs[tie] for tie in range(1, a.tie_seeds)}
    print(f"\n{total} cell runs in {wall_s:.0f} s", file=sys.stderr)
    finish(doc, a.targets, a.out, a.leave_out)
    return 0


def report(
    argv: list[str], seeds: list[int], results: list[dict[str, Any]], **run: Any
) -> dict[str, Any]:
    """The run's document: how it was run (``run`` adds to the command and seeds), the
    summary, every cell."""
    return {
        "run": {
            "command": "python tests/bench/bench_quality_matrix.py " + shlex.join(argv),
            "seeds": seeds,
            "tuning_seed": seeds[0],
            "held_out_seeds": seeds[1:],
            **run,
        },
        "summary": summarize(results, seeds),
        "cells": results,
    }


def merge_main(a: argparse.Namespace, argv: list[str]) -> int:
    """``--merge``: join the runs, report, write."""
    docs = [json.loads(f.read_text()) for f in a.merge]
    try:
        results, seeds = merge_runs(docs, a.seed)
        setup = same_setup(docs)
        ties = merge_ties(docs, seeds)
    except ValueError as e:
        print(f"bench_quality_matrix: --merge: {e}", file=sys.stderr)
        return 2
    doc = report(
        argv,
        seeds,
        results,
        merged=[str(f) for f in a.merge],
        policies=list(results[0]["policies"]) if results else [],
        **setup,
        wall_s=sum(d["run"]["wall_s"] for d in docs),
        jobs=len(docs),
        tie_seeds=len(ties) + 1,
    )
    if ties:
        doc["ties"] = ties
    finish(doc, a.targets, a.out, a.leave_out)
    return 0


def finish(
    doc: dict[str, Any], policy: str, out: Path | None, left_out: Sequence[str] = ()
) -> None:
    """Print the summary and ``policy``'s targets (compared without ``left_out``); write
    ``out``.md / .json if given."""
    results, seeds = doc["cells"], doc["run"]["seeds"]
    print(summary_table(doc["summary"]))
    table = print_targets(results, seeds, policy, left_out)
    ties = print_ties(doc, policy, left_out)
    if out is None:
        return
    base = out.with_suffix("") if out.suffix in (".md", ".json") else out
    base.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{base}.json").write_text(json.dumps(doc, indent=1) + "\n")
    text = markdown(doc)
    for extra in (table, ties):
        if extra:
            text += "\n" + extra + "\n"
    Path(f"{base}.md").write_text(text)
    print(f"wrote {base}.md and {base}.json", file=sys.stderr)


def print_targets(
    results: list[dict[str, Any]], seeds: list[int], policy: str, left_out: Sequence[str] = ()
) -> str:
    """Print and return ``policy``'s targets table ("" when it is not in the run)."""
    if not any(policy in r["policies"] for r in results):
        return ""
    text = left_out_note(left_out) + targets_table(
        policy, targets(leave_out(results, left_out, policy), seeds, policy)
    )
    print("\n" + text)
    return text


def left_out_note(left_out: Sequence[str]) -> str:
    return f"Compared without: {', '.join(left_out)} (--leave-out).\n\n" if left_out else ""


def print_ties(doc: dict[str, Any], policy: str, left_out: Sequence[str] = ()) -> str:
    """With ``--tie-seeds``: print and return the tie seeds' table (else "")."""
    if "ties" not in doc or not any(policy in r["policies"] for r in doc["cells"]):
        return ""
    runs = {0: doc["cells"], **{int(t): rs for t, rs in doc["ties"].items()}}
    runs = {t: leave_out(rs, left_out, policy) for t, rs in runs.items()}
    text = left_out_note(left_out) + ties_table(runs, doc["run"]["seeds"], policy)
    print("\n" + text)
    return text


if __name__ == "__main__":
    sys.exit(main())
