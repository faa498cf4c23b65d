"""``bench_quality_matrix.py --tie-seeds K``: the matrix under every policy's tie seeds
0..K-1, each cell's p90 band and a policy's verdict under each draw."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from scoring.replay import matrix
from scoring.replay.matrix_merge import merge_ties
from scoring.replay.matrix_ties import bands, tie_targets, ties_table, verdicts
from tests.support.bench_module import load_bench

bench = load_bench("bench_quality_matrix")


def cell(name: str, **p90: float) -> dict[str, Any]:
    return {
        "cell": name,
        "seed": 0,
        "policies": {
            p: {"ttft_p90_s": t, "hit_rate": 0.5, "imbalance": 1.0} for p, t in p90.items()
        },
    }


RUNS = {
    0: [
        cell("pass", cost=1.0, llmd=2.0),
        cell("miss", cost=3.0, llmd=1.0),
        cell("draw", cost=1.0, llmd=1.0),
    ],
    1: [
        cell("pass", cost=1.2, llmd=2.0),
        cell("miss", cost=2.0, llmd=1.0),
        cell("draw", cost=1.5, llmd=1.0),
    ],
}


def test_a_verdict_is_robust_only_when_every_tie_seed_gives_it() -> None:
    v = verdicts(RUNS, "cost")
    assert v[("pass", 0)] == [0.5, 0.6]
    assert v[("miss", 0)] == [3.0, 2.0]
    assert v[("draw", 0)] == [1.0, 1.5]
    text = ties_table(RUNS, [0], "cost")
    assert "under every tie seed: 1 of 3 cells; under none: 1; the draw's: 1." in text


def test_each_policy_gets_its_lowest_and_highest_p90_over_the_draws() -> None:
    b = bands(RUNS)
    assert b[("draw", 0)] == {"cost": (1.0, 1.5), "llmd": (1.0, 1.0)}
    assert "| draw | 0 | 1 - 1.5 | 1 - 1 | 1.00 - 1.50 |" in ties_table(RUNS, [0], "cost")


def test_the_targets_are_counted_under_each_tie_seed() -> None:
    figures = tie_targets(RUNS, [0], "cost")
    assert figures[0]["tuning"]["p90_within"] == 2  # pass and draw
    assert figures[1]["tuning"]["p90_within"] == 1  # pass only


def test_a_tie_seed_is_every_seeded_policys_seed_unless_a_variant_sets_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built: dict[str, dict[str, Any]] = {}
    replay = matrix._replay

    def recording(
        trace: Any,
        name: str,
        cfg: Any,
        params: Any = None,
        json_share: float = 0.0,
        json_scrape_s: float | None = None,
        sessions: str = "open",
    ) -> Any:
        built[name + str(params)] = dict(params or {})
        return replay(trace, name, cfg, params, json_share, json_scrape_s, sessions)

    monkeypatch.setattr(matrix, "_replay", recording)
    c = matrix.Cell("chat", 4, "equal", "medium", 0.8)
    out = matrix.run_cell(
        c, 0, policies=["cost", "round_robin"], limit=30, variants=["c7=cost:seed=7"], tie_seed=3
    )
    assert out["tie_seed"] == 3
    assert sorted(map(str, built.values())) == sorted(
        ["{'seed': 3}", "{}", "{'seed': 7}"]  # cost; round_robin has no seed; the variant's
    )
    assert set(out["policies"]) == {"cost", "round_robin", "c7"}


def test_the_bench_reports_the_tie_seeds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["--cells", "chat/p8-equal/medium/load80", "--limit", "40", "--policy", "cost"]
    args += ["--policy", "llmd", "--tie-seeds", "2", "--out", str(tmp_path / "run")]
    assert bench.main(args) == 0
    md = (tmp_path / "run.md").read_text()
    assert "Tie seeds 0, 1: `cost`'s targets under each" in md
    assert "| chat/p8-equal/medium/load80 | 0 |" in md
    assert "Tie seeds 0, 1" in capsys.readouterr().out
    # the run's JSON replays nothing to print it again
    assert bench.main(["--from-json", str(tmp_path / "run.json")]) == 0
    assert "Tie seeds 0, 1" in capsys.readouterr().out


def test_the_bench_leaves_a_named_row_out_of_the_comparison(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = {
        "run": {"seeds": [0]},
        "summary": {"seeds": {"tuning": 0, "held_out": []}, "policies": {}},
        "cells": [cell("a", cost=1.0, arr=1.5, llmd=1.2)],
        "ties": {"1": [cell("a", cost=1.0, arr=1.5, llmd=1.6)]},
    }
    (tmp_path / "run.json").write_text(json.dumps(run))
    args = ["--from-json", str(tmp_path / "run.json"), "--targets", "arr"]
    assert bench.main(args) == 0
    # against cost too, arr misses under both draws (1.5x)
    assert "under none: 1" in capsys.readouterr().out
    # against llmd alone: 1.25x under draw 0, within under draw 1 (0.94x)
    assert bench.main([*args, "--leave-out", "cost"]) == 0
    out = capsys.readouterr().out
    assert "Compared without: cost (--leave-out)." in out
    assert "under every tie seed: 0 of 1 cells; under none: 0; the draw's: 1." in out


def test_a_tie_seed_count_below_one_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--quick", "--tie-seeds", "0"]) == 2
    assert "--tie-seeds >= 1" in capsys.readouterr().err


def run_doc(**ties: list[dict[str, Any]]) -> dict[str, Any]:
    """A run's JSON: tie seed 0's cells, the others under "ties"."""
    doc: dict[str, Any] = {"cells": ties.pop("t0")}
    if ties:
        doc["ties"] = {k[1:]: v for k, v in ties.items()}
    return doc


def merged_cell(name: str, **p90: float) -> dict[str, Any]:
    c = cell(name, **p90)
    for m in c["policies"].values():
        m.update(ttft_p50_s=m["ttft_p90_s"] / 2, ttft_p99_s=2 * m["ttft_p90_s"])
    return {**c, "requests": 10, "ceilings": {"pooled": 0.5}}


def test_merge_joins_tie_runs_draw_by_draw() -> None:
    peers = run_doc(t0=[merged_cell("a", llmd=2.0)], t1=[merged_cell("a", llmd=1.0)])
    mine = run_doc(t0=[merged_cell("a", cost=1.5)], t1=[merged_cell("a", cost=1.5)])
    ties = merge_ties([peers, mine], [0])
    (joined,) = ties["1"]
    assert joined["policies"]["cost"]["p90_vs_best"] == 1.5  # against draw 1's llmd
    assert joined["policies"]["llmd"]["p90_vs_best"] == 1.0
    assert merge_ties([{"cells": []}, {"cells": []}], [0]) == {}


def test_merge_refuses_runs_drawn_under_different_tie_seeds() -> None:
    with pytest.raises(ValueError, match="tie seeds"):
        merge_ties([run_doc(t0=[], t1=[]), run_doc(t0=[])], [0])
