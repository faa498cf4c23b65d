"""``bench_quality_matrix.py --merge``: runs of different policies on the same cells,
joined cell by cell, their ratios recomputed against the joined cell's best."""

from __future__ import annotations

from typing import Any

import pytest

from scoring.replay.matrix_merge import merge_runs, same_setup


def cell(name: str, seed: int, requests: int = 100, **p90: float) -> dict[str, Any]:
    return {
        "cell": name,
        "seed": seed,
        "requests": requests,
        "ceilings": {"infinite": 0.5, "pooled": 0.4},
        "policies": {
            p: {"ttft_p50_s": t / 2, "ttft_p90_s": t, "ttft_p99_s": 2 * t} for p, t in p90.items()
        },
    }


def test_merge_joins_policies_per_cell_and_recomputes_the_ratios() -> None:
    peers = {"cells": [cell("a", 0, cost=2.0, llmd=4.0), cell("a", 1, cost=3.0, llmd=1.5)]}
    mine = {"cells": [cell("a", 1, measured=1.0), cell("a", 0, measured=8.0)]}
    results, seeds = merge_runs([peers, mine], None)
    assert seeds == [0, 1]
    by_seed = {r["seed"]: r["policies"] for r in results}
    assert by_seed[0]["cost"]["p90_vs_best"] == 1.0
    assert by_seed[0]["measured"]["p90_vs_best"] == 4.0
    assert by_seed[1]["llmd"]["p90_vs_best"] == 1.5  # measured's 1.0 is now the best


def test_merge_refuses_different_traces_and_incomplete_cells() -> None:
    a = {"cells": [cell("a", 0, cost=1.0)]}
    with pytest.raises(ValueError, match="different traces"):
        merge_runs([a, {"cells": [cell("a", 0, requests=99, measured=1.0)]}], None)
    with pytest.raises(ValueError, match="policy sets"):
        merge_runs([a, {"cells": [cell("b", 0, measured=1.0)]}], None)


def test_merge_refuses_runs_replayed_with_sessions_open_and_closed() -> None:
    def run(**setup: Any) -> dict[str, Any]:
        return {"run": {"block_size": 16, "pod_model": "vllm", **setup}, "cells": []}

    open_run = {"block_size": 16, "pod_model": "vllm", "sessions": "open"}
    assert same_setup([run(), run(sessions="open")]) == {
        **open_run,
        "preset": "llama3-8b-h100",
    }  # a run before --sessions was open, one before --preset on the first preset
    assert same_setup([run(sessions="closed")] * 2)["sessions"] == "closed"
    with pytest.raises(ValueError, match=r"'sessions', 'closed'.*'sessions', 'open'"):
        same_setup([run(sessions="closed"), run()])


def test_merge_refuses_runs_on_different_engine_presets() -> None:
    def run(**setup: Any) -> dict[str, Any]:
        return {"run": {"block_size": 16, "pod_model": "vllm", **setup}, "cells": []}

    assert same_setup([run(), run(preset="llama3-8b-h100")])["preset"] == "llama3-8b-h100"
    with pytest.raises(ValueError, match=r"llama3-70b-h100-tp4"):
        same_setup([run(preset="llama3-70b-h100-tp4"), run()])
    # the simple pod model has no engine preset
    assert "preset" not in same_setup([{"run": {"block_size": 64, "pod_model": "simpod"}}])
