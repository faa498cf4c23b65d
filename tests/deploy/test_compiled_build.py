"""The optional compiled build (setup.py, scoring/compiled.py): mypyc compiles the
decision's hot modules into C extensions, and they decide exactly as the sources do.

The build test needs a C compiler, Python's headers and mypyc (in the test extras); it
is skipped, saying which is missing, on a machine without them.  It takes about a
minute on 2 cores (mypyc and the C compiler), and runs the app's tests
(tests/router/test_app*.py, :data:`APP_TESTS`) on the build too."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from scoring.compiled import HOT_MODULES, build_kind, compiled_modules, module_names

ROOT = Path(__file__).resolve().parents[2]
PROBE = Path(__file__).resolve().parent / "compiled_probe.py"
#: the router's API tests (the rig: tests/router/app_rig.py), run on the compiled build too
APP_TESTS = [
    f"tests/router/test_app{part}.py"
    for part in ("", "_bad_requests", "_passthrough", "_metrics", "_fleet")
]


def _missing_toolchain() -> str | None:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None:
        return f"no C compiler ({cc})"
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        return "no Python headers (Python.h)"
    if importlib.util.find_spec("mypyc") is None:
        return "no mypyc (pip install mypy)"
    return None


def _setup(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "setup.py", *args],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_every_hot_module_exists_and_runs_wholly_compiled_or_wholly_as_python() -> None:
    for path in HOT_MODULES:
        assert (ROOT / path).is_file(), path
    assert module_names()[0] == "scoring.blocks"
    assert set(compiled_modules()) == set(module_names())
    assert build_kind() in ("python", "compiled")  # never a mix


@pytest.mark.parametrize(
    ("flag", "args", "message"),
    [
        ("yes", ["--name"], "KVROUTE_COMPILE must be 0 or 1, got 'yes'"),
        ("1", ["editable_wheel"], "needs a regular install"),
    ],
)
def test_setup_refuses_a_bad_flag_and_a_compiled_editable_install_in_one_line(
    flag: str, args: list[str], message: str
) -> None:
    done = _setup({"KVROUTE_COMPILE": flag}, *args)
    assert done.returncode != 0
    assert message in done.stderr
    assert done.stderr.strip().count("\n") == 0


def test_without_the_flag_the_install_is_pure_python() -> None:
    done = _setup({"KVROUTE_COMPILE": "0"}, "--name")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "kvroute"


def _python(pythonpath: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``python ARGS`` in ``cwd`` with only ``pythonpath`` on PYTHONPATH."""
    return subprocess.run(
        [sys.executable, *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(pythonpath)},
        capture_output=True,
        text=True,
        timeout=600,
    )


def _probe(pythonpath: Path, cwd: Path) -> dict[str, object]:
    done = _python(pythonpath, cwd, str(PROBE))
    assert done.returncode == 0, done.stderr[-2000:]
    result: dict[str, object] = json.loads(done.stdout)
    return result


def test_a_compiled_build_decides_exactly_as_the_sources(tmp_path: Path) -> None:
    missing = _missing_toolchain()
    if missing:
        pytest.skip(f"compiled build: {missing}")
    # build a copy in place (setup.py's extensions, as a wheel would carry them), so
    # that no build output lands in the checkout
    build = tmp_path / "build"
    build.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, build / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info")
    for package in ("scoring", "router", "tests"):
        shutil.copytree(ROOT / package, build / package, ignore=ignore)
    built = subprocess.run(
        [sys.executable, "setup.py", "build_ext", "--inplace"],
        cwd=build,
        env={**os.environ, "KVROUTE_COMPILE": "1"},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    for path in HOT_MODULES:
        assert (build / path.replace(".py", suffix)).is_file(), path
    elsewhere = tmp_path / "elsewhere"  # no checkout on the path but PYTHONPATH's
    elsewhere.mkdir()
    compiled = _probe(build, elsewhere)
    source = _probe(ROOT, elsewhere)
    assert compiled["build"] == "compiled"
    assert source["build"] == "python"
    assert compiled["replays"] == source["replays"]
    assert compiled["speculative"] == source["speculative"]
    assert compiled["keys"] == source["keys"]
    # the router around the compiled policy: the app's own tests, run on the build
    app_tests = _python(build, build, "-m", "pytest", "-q", "-p", "no:cacheprovider", *APP_TESTS)
    assert app_tests.returncode == 0, app_tests.stdout[-3000:]
    assert " passed" in app_tests.stdout.strip().splitlines()[-1]
