"""The Helm chart (``helm/kvroute``) as the tests render it, with real Helm.

Helm comes from ``helm-python-sdk``: Helm v4's Go SDK behind a C ABI, loaded with ctypes
(no ``helm`` binary, no cluster).  :func:`render` renders the chart the way ``helm
template`` does and reads the manifests back as YAML; :func:`router_settings` loads the
router's config file found in the ConfigMap with kvroute's own
:class:`router.config.Settings`, and the container's argv with kvroute's own CLI parsing,
so the chart cannot drift from the code.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from router.config import Settings
from tests.deploy.helm_schema import CHART, ROOT, SCHEMA
from tests.deploy.helm_values import (
    CONFIG_KEY,
    K8S_DISCOVERY,
    MODES,
    NAMESPACE,
    PD_K8S_POOLS,
    PD_STATIC_POOLS,
    RELEASE,
    STATIC_PODS,
)

# Helm reads its cache/config/data homes from the environment, which a Go library copies
# when it is loaded: point them at a scratch directory before the import.
_HELM_HOME = Path(tempfile.gettempdir()) / "kvroute-tests-helm-home"
for _var, _sub in (("HELM_CACHE_HOME", "cache"), ("HELM_CONFIG_HOME", "config")):
    os.environ.setdefault(_var, str(_HELM_HOME / _sub))
os.environ.setdefault("HELM_DATA_HOME", str(_HELM_HOME / "data"))

helm = pytest.importorskip(
    "helm_python",
    reason="helm-python-sdk (the test extra: pip install -e '.[test]') is not installed",
)

__all__ = [
    "CHART",
    "CONFIG_KEY",
    "K8S_DISCOVERY",
    "MODES",
    "NAMESPACE",
    "PD_K8S_POOLS",
    "PD_STATIC_POOLS",
    "RELEASE",
    "ROOT",
    "SCHEMA",
    "STATIC_PODS",
]


def render(values: dict[str, Any] | None = None, chart: Path = CHART) -> list[dict[str, Any]]:
    """``helm template`` of ``chart``: every non-empty manifest document, parsed."""
    with helm.Chart.load(chart) as loaded:
        out = loaded.render(values or {}, name=RELEASE, namespace=NAMESPACE)
    docs: list[dict[str, Any]] = []
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc is not None:
                assert isinstance(doc, dict), f"{path}: a document that is not a mapping"
                docs.append(doc)
    return docs


def notes(values: dict[str, Any] | None = None) -> str:
    with helm.Chart.load(CHART) as loaded:
        out = loaded.render(values or {}, name=RELEASE, namespace=NAMESPACE)
    return next(text for path, text in out.items() if path.endswith("NOTES.txt"))


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str, component: str = "router") -> dict[str, Any]:
    found = [
        d
        for d in of_kind(docs, kind)
        if d["metadata"]["labels"].get("app.kubernetes.io/component") == component
    ]
    assert len(found) == 1, f"expected one {component} {kind}, found {len(found)}"
    return found[0]


def container(deployment: dict[str, Any]) -> dict[str, Any]:
    containers = deployment["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return dict(containers[0])


def mounted_files(docs: list[dict[str, Any]], deployment: dict[str, Any], root: Path) -> dict:
    """Materialise the container's ConfigMap volumes under ``root``; return
    {mountPath: local dir}."""
    spec = deployment["spec"]["template"]["spec"]
    configmaps = {d["metadata"]["name"]: d for d in of_kind(docs, "ConfigMap")}
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts: dict[str, Path] = {}
    for m in container(deployment)["volumeMounts"]:
        volume = volumes[m["name"]]
        if "configMap" not in volume:
            continue
        local = root / m["name"]
        local.mkdir(parents=True, exist_ok=True)
        for key, text in configmaps[volume["configMap"]["name"]]["data"].items():
            (local / key).write_text(text)
        mounts[m["mountPath"]] = local
    return mounts


def argv_in(docs: list[dict[str, Any]], deployment: dict[str, Any], root: Path) -> list[str]:
    """The container's command + args, with paths inside mounted ConfigMaps pointing at
    their rendered content under ``root``."""
    c = container(deployment)
    mounts = mounted_files(docs, deployment, root)
    argv = [str(a) for a in [*c.get("command", []), *c.get("args", [])]]
    out = []
    for a in argv:
        for mount, local in mounts.items():
            if a.startswith(mount.rstrip("/") + "/"):
                a = str(local / a[len(mount.rstrip("/")) + 1 :])
        out.append(a)
    return out


def router_settings(docs: list[dict[str, Any]], root: Path) -> Settings:
    """Settings exactly as the router container loads them (its argv, its config file)."""
    argv = argv_in(docs, one(docs, "Deployment"), root)
    assert argv[:2] == ["kvroute", "serve"], argv
    return Settings.load(argv[2:], env_config=False)


def config_file(docs: list[dict[str, Any]]) -> dict[str, Any]:
    cm = next(d for d in of_kind(docs, "ConfigMap") if CONFIG_KEY in d.get("data", {}))
    loaded = yaml.safe_load(cm["data"][CONFIG_KEY])
    assert isinstance(loaded, dict)
    return loaded


def chart_copy(tmp_path: Path, *, schema: bool = True, dashboards: dict[str, str]) -> Path:
    """A copy of the chart with exactly ``dashboards`` in dashboards/ (and no schema when
    ``schema`` is false)."""
    dst = tmp_path / "kvroute"
    shutil.copytree(CHART, dst, ignore=shutil.ignore_patterns("dashboards"))
    (dst / "dashboards").mkdir()
    for name, text in dashboards.items():
        (dst / "dashboards" / name).write_text(text)
    if not schema:
        (dst / "values.schema.json").unlink()
    return dst
