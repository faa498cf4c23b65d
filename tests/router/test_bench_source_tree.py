"""Benchmarks that run another checkout's kvroute (``--baseline DIR``, ``--variant
...=DIR``) run that checkout's code, even when started from this checkout's root: with
``PYTHONPATH`` alone, ``python -m`` imports this checkout's ``router`` and ``scoring``
from the working directory, ahead of ``PYTHONPATH``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.bench_module import load_bench

ROOT = Path(__file__).resolve().parents[2]
source_tree = load_bench("source_tree")


def _run_from_tree(tmp_path: Path, cwd: str | Path | None) -> subprocess.CompletedProcess[str]:
    """``python -m scoring.where`` with ``PYTHONPATH`` = a tree whose ``scoring`` package
    has a module ``where`` (printing its file) that this checkout's has not."""
    tree = tmp_path / "other"
    (tree / "scoring").mkdir(parents=True, exist_ok=True)
    (tree / "scoring" / "__init__.py").write_text("")
    (tree / "scoring" / "where.py").write_text("print(__file__)\n")
    return subprocess.run(
        [sys.executable, "-m", "scoring.where"],
        env=source_tree.tree_env(str(tree)),
        cwd=cwd,
        capture_output=True,
        text=True,
        check=False,
    )


def test_pythonpath_alone_runs_this_checkouts_code_from_its_root(tmp_path: Path) -> None:
    done = _run_from_tree(tmp_path, cwd=ROOT)
    # this checkout's scoring package was found first, and it has no module "where"
    assert done.returncode != 0
    assert "No module named scoring.where" in done.stderr


def test_the_trees_code_runs_with_its_cwd_and_pythonpath(tmp_path: Path) -> None:
    tree = tmp_path / "other"
    done = _run_from_tree(tmp_path, cwd=source_tree.tree_cwd(str(tree)))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tree / "scoring" / "where.py")


def test_no_tree_leaves_the_environment_and_directory_alone() -> None:
    assert source_tree.tree_cwd(None) is None
    assert "PYTHONPATH" not in source_tree.tree_env(None, {"A": "1"})
    assert source_tree.tree_env("/x", {"A": "1"}) == {"A": "1", "PYTHONPATH": "/x"}
