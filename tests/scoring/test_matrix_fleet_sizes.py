"""``bench_quality_matrix.py --fleet-sizes N ...``: the full matrix on fleets of sizes the
defaults were never looked at on (held out), with each fleet kind, cache and load."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scoring.replay.matrix import FLEET_KINDS, FLEET_SIZES, full_matrix, select
from tests.support.bench_module import load_bench

bench = load_bench("bench_quality_matrix")


def test_the_full_matrix_takes_other_fleet_sizes_in_every_fleet_kind() -> None:
    default = full_matrix()
    held_out = full_matrix((2, 32))

    assert {c.pods for c in default} == set(FLEET_SIZES) == {4, 8, 16}
    assert {c.pods for c in held_out} == {2, 32}
    assert len(held_out) == len(default) * 2 // 3  # two sizes where there were three
    for n in (2, 32):
        assert {c.caches for c in held_out if c.pods == n} == set(FLEET_KINDS)
    assert [c.id for c in select(held_out, ["chat/p32-unequal/small/load110"])] == [
        "chat/p32-unequal/small/load110"
    ]


def test_the_bench_replays_a_held_out_fleet_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cell = "chat/p2-unequal/small/load110"
    run = tmp_path / "run"
    sizes_and_cell = ["--fleet-sizes", "2", "--cells", cell, "--limit", "40"]
    assert (
        bench.main([*sizes_and_cell, "--policy", "cost", "--policy", "llmd", "--out", str(run)])
        == 0
    )

    (out,) = json.loads(run.with_suffix(".json").read_text())["cells"]
    assert out["cell"] == cell
    assert out["fleet"]["pods"] == len(out["fleet"]["pod_capacity_tokens"]) == 2
    assert set(out["policies"]) == {"cost", "llmd"}
    assert cell in capsys.readouterr().out


@pytest.mark.parametrize("args", [["--fleet-sizes", "1"], ["--fleet-sizes", "65"]])
def test_a_fleet_size_outside_2_to_64_is_refused_in_one_line(
    args: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert bench.main([*args, "--list"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--fleet-sizes takes pod counts within [2, 64]" in err


def test_fleet_sizes_are_refused_with_the_quick_matrix(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert bench.main(["--quick", "--fleet-sizes", "32", "--list"]) == 2
    assert "not with --quick" in capsys.readouterr().err
