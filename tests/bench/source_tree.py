"""Run another checkout's kvroute from a benchmark (``--baseline DIR``, ``--variant
...=DIR``): its directory must be the child's working directory as well as its
``PYTHONPATH``.  ``python -m`` puts the working directory first on ``sys.path``, ahead of
``PYTHONPATH``, so a child started from this checkout's root with only ``PYTHONPATH=DIR``
imports this checkout's code, not DIR's."""

from __future__ import annotations

import os


def tree_env(tree: str | None, base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with ``PYTHONPATH=tree`` if given."""
    env = dict(os.environ if base is None else base)
    if tree:
        env["PYTHONPATH"] = tree
    return env


def tree_cwd(tree: str | None) -> str | None:
    """The working directory a child running ``tree``'s code needs (None: unchanged)."""
    return tree or None
