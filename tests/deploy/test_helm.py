"""The Helm chart (``helm/kvroute``), rendered by real Helm: ``helm lint`` and the shape
of every rendered document in every deployment mode, and a default release that starts a
router that turns ready.  The other parts of the chart are specified beside this file
(``test_helm_config``, ``_rbac``, ``_redis``, ``_router_pod``, ``_optional``, ``_epp``,
``_tenants``); the rendering helpers are in :mod:`tests.deploy.helm_chart` (re-exported
here for the modules that import them from this one).

``python tests/deploy/test_helm.py --write-schema`` regenerates the ``$defs`` of
``values.schema.json`` (the schema of ``config:``) from the Settings model.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

if str(Path(__file__).resolve().parents[2]) not in sys.path:  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.deploy.conftest import no_kvroute_env, stop
from tests.deploy.helm_schema import write_schema
from tests.deploy.helm_values import MODES

if __name__ != "__main__":  # the schema writer below needs no Helm
    from tests.deploy.helm_chart import (
        CHART,
        CONFIG_KEY,
        K8S_DISCOVERY,
        NAMESPACE,
        PD_K8S_POOLS,
        PD_STATIC_POOLS,
        RELEASE,
        ROOT,
        SCHEMA,
        STATIC_PODS,
        argv_in,
        chart_copy,
        config_file,
        container,
        helm,
        mounted_files,
        notes,
        of_kind,
        one,
        render,
        router_settings,
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
    "argv_in",
    "chart_copy",
    "config_file",
    "container",
    "helm",
    "mounted_files",
    "no_kvroute_env",
    "notes",
    "of_kind",
    "one",
    "render",
    "router_settings",
]

# -- lint and the shape of every document ------------------------------------------------------


def test_helm_lint_passes_without_errors_or_warnings() -> None:
    report = helm.lint(CHART, namespace=NAMESPACE, strict=True)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


@pytest.mark.parametrize("mode", MODES)
def test_helm_lint_passes_in_every_mode(mode: str) -> None:
    report = helm.lint(CHART, MODES[mode], namespace=NAMESPACE, strict=True)
    assert report["errors"] == [], report


@pytest.mark.parametrize("mode", MODES)
def test_every_rendered_document_is_a_named_kubernetes_object(mode: str) -> None:
    docs = render(MODES[mode])
    assert docs
    for doc in docs:
        assert doc.get("apiVersion") and doc.get("kind"), doc
        assert doc["metadata"].get("name"), doc
        assert len(doc["metadata"]["name"]) <= 63
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names)), f"duplicate objects: {names}"


@pytest.mark.parametrize("mode", MODES)
def test_the_router_loads_the_rendered_config_with_its_own_settings_model(
    mode: str, tmp_path: Path, no_kvroute_env: None
) -> None:
    docs = render(MODES[mode])
    settings = router_settings(docs, tmp_path)
    expected = MODES[mode].get("config", {})
    for key, value in expected.items():
        dumped = settings.model_dump(mode="json", exclude_none=True)[key]
        if isinstance(value, dict):  # the values' keys are all there, with their values
            for sub, sub_value in value.items():
                got = dumped[sub]
                if isinstance(sub_value, dict):
                    assert {k: got[k] for k in sub_value} == sub_value
                elif isinstance(sub_value, list):
                    assert [
                        {k: g[k] for k in s} for g, s in zip(got, sub_value, strict=True)
                    ] == sub_value
                else:
                    assert got == sub_value
        else:
            assert dumped == value


@pytest.mark.parametrize("mode", MODES)
def test_the_router_listens_where_the_service_and_the_probes_look(
    mode: str, tmp_path: Path, no_kvroute_env: None
) -> None:
    docs = render(MODES[mode])
    settings = router_settings(docs, tmp_path)
    c = container(one(docs, "Deployment"))
    (http,) = [p for p in c["ports"] if p["name"] == "http"]
    assert settings.host == "0.0.0.0"  # not the loopback default: probes come from the kubelet
    assert settings.port == http["containerPort"]
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    service = one(docs, "Service")
    assert service["spec"]["type"] == "ClusterIP"
    (port,) = service["spec"]["ports"]
    assert port["name"] == "http" and port["port"] == 8000 and port["targetPort"] == "http"
    router_pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= router_pod_labels.items()


def test_the_default_release_starts_a_router_that_turns_ready(tmp_path: Path) -> None:
    """The rendered argv and config file, run for real (on loopback: the flags beat the
    file's 0.0.0.0), answer the chart's probes: /health at once, /ready once the
    embedded simulated fleet the defaults start is healthy."""
    docs = render({"config": {"fleet": {"pods": 2}}})
    argv = argv_in(docs, one(docs, "Deployment"), tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "router.cli", *argv[1:], "--host", "127.0.0.1"]
    cmd += ["--port", str(port)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        ready = None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                ready = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=2)
            except httpx.TransportError:
                time.sleep(0.2)
                continue
            assert health.status_code == 200
            if ready.status_code == 200:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate(timeout=5)[1].decode()[-2000:]
        assert ready is not None and ready.status_code == 200, ready and ready.text
    finally:
        stop(proc)


if __name__ == "__main__":
    if sys.argv[1:] != ["--write-schema"]:
        sys.exit("usage: python tests/deploy/test_helm.py --write-schema")
    write_schema()
