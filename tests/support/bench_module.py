"""Import a script of ``tests/bench/`` as a module, for tests of its pieces.

The bench folder is not a package (pytest ignores it), so its scripts are loaded by path.
The module is registered in ``sys.modules`` (dataclasses look their module up there), and
``tests/bench`` is on ``sys.path`` while it executes, so a script may import its siblings.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCH_DIR = Path(__file__).resolve().parents[1] / "bench"


def load_bench(script: str, name: str | None = None) -> ModuleType:
    """``tests/bench/<script>.py`` executed as the module ``name`` (default: ``script``)."""
    spec = importlib.util.spec_from_file_location(name or script, BENCH_DIR / f"{script}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    sys.path.insert(0, str(BENCH_DIR))
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(BENCH_DIR))
    return mod
