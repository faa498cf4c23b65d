"""The decision's hot modules that a compiled build turns into C extensions, and whether
this process runs them compiled.

``KVROUTE_COMPILE=1 pip install --no-build-isolation .`` (with ``mypy`` installed: it
ships mypyc) compiles :data:`HOT_MODULES` with mypyc (setup.py); a plain install runs
them as Python.  Both run the same source: the compiled build changes speed, not
decisions (tests/deploy/test_compiled_build.py replays traces both ways and compares every
request).  Only what the benchmarks showed paying is listed: ``cost``'s pick and hooks
and the structures they walk (``python tests/bench/bench_decide_cost.py``: 28.9 -> 16.1 us a
request with its four hooks), the speculative index and the block hasher.

This module imports nothing at load: setup.py reads :data:`HOT_MODULES` from it before
the package is built.
"""

from __future__ import annotations

#: source files compiled by ``KVROUTE_COMPILE=1`` (paths from the repository root)
HOT_MODULES = (
    "scoring/blocks.py",
    "scoring/index/speculative.py",
    "scoring/policies/cost.py",
    "scoring/policies/cost_ledger.py",
    "scoring/policies/hot_set.py",
    "scoring/policies/inflight.py",
    "scoring/policies/kv_admission.py",
    "scoring/policies/learned_rate.py",
    "scoring/policies/queued.py",
    "scoring/policies/slowdown_fit.py",
    "scoring/policies/tiers.py",
)


def module_names() -> list[str]:
    """:data:`HOT_MODULES` as dotted module names."""
    return [path.removesuffix(".py").replace("/", ".") for path in HOT_MODULES]


def compiled_modules() -> dict[str, bool]:
    """Per hot module: whether this process imported it compiled (a C extension)."""
    import importlib
    import importlib.machinery

    suffixes = tuple(importlib.machinery.EXTENSION_SUFFIXES)
    out: dict[str, bool] = {}
    for name in module_names():
        module = importlib.import_module(name)
        out[name] = (getattr(module, "__file__", None) or "").endswith(suffixes)
    return out


def build_kind() -> str:
    """``"compiled"`` (every hot module), ``"python"`` (none) or ``"partial"``."""
    flags = compiled_modules().values()
    if all(flags):
        return "compiled"
    return "partial" if any(flags) else "python"
