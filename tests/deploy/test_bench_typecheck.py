"""The benchmark scripts (tests/bench) type-check against the code they drive.

No test runs them: they need minutes, peers and a quiet machine.  So a refactor that
changes a helper's signature can break one silently: session 23 found
``bench_live_quality.py`` still calling ``start_sglang(urls, policy)`` after the helper
had taken the peer's python first, which only a full live run (six minutes in) showed.
mypy sees such a call without running anything (about 20 s cold)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"


def test_every_bench_script_type_checks_against_the_code_it_calls(tmp_path: Path) -> None:
    scripts = sorted(p.name for p in BENCH.glob("*.py"))
    assert "bench_live_quality.py" in scripts and len(scripts) > 20
    # the scripts import each other as top-level modules (their directory is sys.path[0]),
    # so mypy runs there; the project's code is analysed, its errors reported elsewhere
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--follow-imports=silent",
            "--cache-dir",
            str(tmp_path),
            *scripts,
        ],
        cwd=BENCH,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
