"""Issue #9's targets computed from a matrix run's results."""

from __future__ import annotations

from typing import Any

import pytest

from scoring.replay.matrix_targets import leave_out, targets, targets_table


def cell(name: str, seed: int, **p90_hit_imb: tuple[float, float, float]) -> dict[str, Any]:
    return {
        "cell": name,
        "seed": seed,
        "policies": {
            p: {"ttft_p90_s": t, "hit_rate": h, "imbalance": i}
            for p, (t, h, i) in p90_hit_imb.items()
        },
    }


def test_targets_compare_with_the_best_other_policy_and_the_best_peer_per_seed_group() -> None:
    results = [
        cell(
            "a", 0, cost=(1.0, 0.9, 1.1), approx_prefix=(2.0, 0.9, 1.0), least_load=(4.0, 0.5, 1.0)
        ),
        cell(
            "a", 1, cost=(3.0, 0.8, 1.5), approx_prefix=(2.0, 0.9, 1.1), least_load=(1.0, 0.5, 1.0)
        ),
        cell(
            "b",
            1,
            cost=(1.0, 0.9, 1.2),
            approx_prefix=(1.02, 0.94, 1.3),
            least_load=(5.0, 0.4, 1.2),
        ),
        {**cell("m", 1, cost=(9.0, 0.1, 9.0), approx_prefix=(1.0, 0.9, 1.0)), "same_as_seed": 0},
    ]
    f = targets(results, [0, 1], "cost")
    tuning, held = f["tuning"], f["held_out"]
    assert tuning["cells"] == 1 and tuning["p90_within"] == 1 and tuning["vs_best_peer"] == 2.0
    # the repeated Mooncake-like cell is left out of the held-out group
    assert held["cells"] == 2
    # cell a: best other is least_load (1.0): 3x, a miss; cell b: 1.0 vs 1.02, within
    assert held["p90_within"] == 1 and held["misses"] == [(3.0, "a", 1)]
    assert held["hit_within"] == 1  # 0.8 < 0.95 * 0.9 in a; 0.9 >= 0.95 * 0.94 in b
    assert (held["balanced"], held["balanced_cells"]) == (1, 2)
    # geomeans over the cell's best: cost (3, 1) -> sqrt 3; approx (2, 1.02)
    assert held["vs_best_peer"] == pytest.approx((2.0 * 1.02) ** 0.5 / 3**0.5)
    table = targets_table("cost", f)
    assert "| 1 / 2 (worst: a s1 3.00x) |" in table


def test_a_policy_run_alone_has_no_other_to_be_within_of() -> None:
    f = targets([cell("a", 0, cost=(1.0, 0.9, 1.1))], [0], "cost")
    assert (f["tuning"]["cells"], f["tuning"]["compared"], f["tuning"]["p90_within"]) == (1, 0, 0)
    table = targets_table("cost", f)
    assert "0 / 1" not in table
    assert table.count("no other policy in the run") == 3
    assert "no peer in the run" in table


def test_a_variant_is_judged_against_the_peers_alone_when_its_base_is_left_out() -> None:
    results = [
        cell("a", 0, cost=(1.0, 0.9, 1.0), arr=(1.5, 0.9, 1.0), llmd=(1.45, 0.9, 1.0)),
        cell("b", 0, cost=(2.0, 0.9, 1.0), arr=(2.0, 0.9, 1.0), llmd=(3.0, 0.9, 1.0)),
    ]
    # against every other row, cost beats the variant in cell a by 1.5x
    assert targets(results, [0], "arr")["tuning"]["misses"] == [(1.5, "a", 0)]
    alone = leave_out(results, ["cost"], "arr")
    f = targets(alone, [0], "arr")["tuning"]
    assert (f["p90_within"], f["misses"]) == (2, [])
    # the geomeans are over each cell's best without cost: llmd (1, 1.5), arr (1.5 / 1.45, 1)
    assert f["vs_best_peer"] == pytest.approx((1.5 / (1.5 / 1.45)) ** 0.5)
    # the input is not changed, and the policy judged is never left out of its own rows
    assert "cost" in results[0]["policies"]
    assert leave_out(results, ["arr"], "arr") == results
