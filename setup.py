"""Optional compiled build (the project's metadata is in pyproject.toml).

``KVROUTE_COMPILE=1 pip install --no-build-isolation .`` compiles the decision's hot
modules (scoring/compiled.py) with mypyc, which ships with mypy; without the variable
the install is pure Python.  A regular install only: in an editable one the compiled
modules would sit beside the sources and shadow every later edit of them.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from setuptools import setup


def _ext_modules() -> list[object]:
    flag = os.environ.get("KVROUTE_COMPILE", "")
    if flag in ("", "0"):
        return []
    if flag != "1":
        sys.exit(f"KVROUTE_COMPILE must be 0 or 1, got {flag!r}")
    if "editable_wheel" in sys.argv:
        sys.exit(
            "KVROUTE_COMPILE=1 needs a regular install (pip install --no-build-isolation .), "
            "not an editable one: compiled modules beside the sources would shadow your edits"
        )
    try:
        from mypyc.build import mypycify
    except ImportError:
        sys.exit(
            "KVROUTE_COMPILE=1 needs mypyc in the build environment: "
            "pip install 'mypy>=1.10', then KVROUTE_COMPILE=1 pip install --no-build-isolation ."
        )
    here = Path(__file__).resolve().parent
    hot = runpy.run_path(str(here / "scoring" / "compiled.py"))["HOT_MODULES"]
    return list(mypycify(list(hot), opt_level="3"))


setup(ext_modules=_ext_modules())
