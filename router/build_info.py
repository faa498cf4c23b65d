"""Which kvroute a process runs: the installed version (:func:`kvroute_version`) and the
``kvroute_build_info`` gauge (:func:`register_build_info`).  Both are re-exported by
:mod:`router.metrics`."""

from __future__ import annotations

import platform

from prometheus_client import CollectorRegistry, Gauge


def kvroute_version() -> str:
    """The installed kvroute's version ("unknown" when run from a tree not installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvroute")
    except PackageNotFoundError:
        return "unknown"


def register_build_info(registry: CollectorRegistry, component: str, policy: str = "") -> None:
    """``kvroute_build_info{version, python, build, component, policy} 1``: which
    kvroute a process runs (a rollout shows as two versions side by side), whether its
    decision's hot modules are compiled (``build``: compiled, python or partial;
    scoring/compiled.py), as what (``serve``, ``index``) and, for a router, with which
    policy."""
    from scoring.compiled import build_kind

    Gauge(
        "kvroute_build_info",
        "Always 1: the kvroute version, Python version, build (compiled, python or "
        "partial: the decision's hot modules), component (serve, index) and routing "
        "policy of this process",
        ["version", "python", "build", "component", "policy"],
        registry=registry,
    ).labels(kvroute_version(), platform.python_version(), build_kind(), component, policy).set(1)
