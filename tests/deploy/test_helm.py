"""The Helm chart (``helm/kvroute``), rendered by real Helm.

Helm comes from ``helm-python-sdk``: Helm v4's Go SDK behind a C ABI, loaded with ctypes
(no ``helm`` binary, no cluster).  Every test renders the chart the way ``helm template``
does and reads the manifests back as YAML; the router's config file found in the
ConfigMap is loaded with kvroute's own :class:`router.config.Settings`, and the
containers' argv with kvroute's own CLI parsing, so the chart cannot drift from the code.

``python tests/deploy/test_helm.py --write-schema`` regenerates the ``$defs`` of
``values.schema.json`` (the schema of ``config:``) from the Settings model.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from pydantic import ValidationError

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kvroute"
SCHEMA = CHART / "values.schema.json"

# Helm reads its cache/config/data homes from the environment, which a Go library copies
# when it is loaded: point them at a scratch directory before the import.
_HELM_HOME = Path(tempfile.gettempdir()) / "kvroute-tests-helm-home"
for _var, _sub in (("HELM_CACHE_HOME", "cache"), ("HELM_CONFIG_HOME", "config")):
    os.environ.setdefault(_var, str(_HELM_HOME / _sub))
os.environ.setdefault("HELM_DATA_HOME", str(_HELM_HOME / "data"))

if __name__ != "__main__":  # the schema writer below needs no Helm
    helm = pytest.importorskip(
        "helm_python",
        reason="helm-python-sdk (the test extra: pip install -e '.[test]') is not installed",
    )

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from router.config import Settings  # noqa: E402
from tests.deploy.conftest import stop  # noqa: E402

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

RELEASE = "kv"
NAMESPACE = "serving"
CONFIG_KEY = "kvroute.yaml"

STATIC_PODS = {
    "discovery": {
        "kind": "static",
        "static": [
            {
                "name": "vllm-0",
                "url": "http://10.0.0.7:8000",
                "events_endpoint": "tcp://10.0.0.7:5557",
                "replay_endpoint": "tcp://10.0.0.7:5657",
                "models": ["Qwen3-8B"],
            },
            {"name": "vllm-1", "url": "http://10.0.0.8:8000", "models": ["Qwen3-8B"]},
        ],
    }
}
K8S_DISCOVERY = {
    "discovery": {
        "kind": "k8s",
        "k8s": {"label_selector": "app=vllm", "events_port": 5557, "replay_port": 5657},
    }
}
#: prefill/decode pools (docs/deploy.md): static pods with roles, the split's settings
PD_STATIC_POOLS = {
    "discovery": {
        "kind": "static",
        "static": [
            {"name": "prefill-0", "url": "http://10.0.1.7:8000", "role": "prefill"},
            {"name": "decode-0", "url": "http://10.0.2.7:8000", "role": "decode"},
        ],
    },
    "pd": {"prefill_policy": "cost", "params": {"min_uncached_tokens": 512}, "kv_lease_s": 30},
}
#: the same pools from pod labels (kvroute.io/role, or llm-d's llm-d.ai/role)
PD_K8S_POOLS = {
    "discovery": {
        "kind": "k8s",
        "k8s": {"label_selector": "app=vllm", "events_port": 5557, "role": "decode"},
    },
    "pd": {"params": {"always_split": False}},
}

#: each deployment mode the chart supports, as the values a user would pass
MODES: dict[str, dict[str, Any]] = {
    "defaults": {},
    "static pods": {"config": STATIC_PODS},
    "kubernetes discovery": {"config": K8S_DISCOVERY},
    "dns discovery": {
        "config": {"discovery": {"kind": "dns", "dns": {"hostname": "vllm-headless"}}}
    },
    "redis external": {
        "replicaCount": 3,
        "redis": {"url": "redis://valkey.cache.svc:6379/0"},
        "config": K8S_DISCOVERY,
    },
    "redis bundled + indexer": {
        "replicaCount": 2,
        "redis": {"enabled": True},
        "config": STATIC_PODS,
    },
    "redis without indexer, one writing replica": {
        "redis": {"enabled": True},
        "indexer": {"enabled": False},
        "config": {"index_writer": True, **STATIC_PODS},
    },
    "serviceMonitor + prometheusRule on": {
        "serviceMonitor": {"enabled": True},
        "prometheusRule": {"enabled": True},
    },
    "hpa on": {"autoscaling": {"enabled": True}, "redis": {"enabled": True}},
    "pdb on": {"podDisruptionBudget": {"enabled": True}, "replicaCount": 2},
    "dashboards off": {"dashboards": {"enabled": False}},
    "prefill/decode pools, static": {"config": PD_STATIC_POOLS},
    "prefill/decode pools, kubernetes labels": {"config": PD_K8S_POOLS},
}


# -- helpers -----------------------------------------------------------------------------


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


@pytest.fixture
def no_kvroute_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings reads KVROUTE_* from the environment: start from none."""
    for name in list(os.environ):
        if name.startswith("KVROUTE_"):
            monkeypatch.delenv(name)


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


# -- the config: one model for CLI, env and Helm values ----------------------------------------


def test_values_config_keys_are_settings_fields() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert set(values["config"]) <= set(Settings.model_fields)
    Settings.model_validate(values["config"])


def test_the_schema_of_config_is_generated_from_the_settings_model() -> None:
    on_disk = json.loads(SCHEMA.read_text())
    assert on_disk["properties"]["config"] == {"$ref": "#/$defs/Settings"}
    assert on_disk["$defs"] == settings_defs(), (
        "values.schema.json is stale: python tests/deploy/test_helm.py --write-schema"
    )


def test_an_unknown_config_key_is_rejected_by_the_chart_schema() -> None:
    with pytest.raises(helm.HelmValuesError, match="polcy"):
        render({"config": {"polcy": "cost"}})
    with pytest.raises(helm.HelmValuesError, match="read_timout_s"):
        render({"config": {"proxy": {"read_timout_s": 30}}})


def test_an_unknown_config_key_is_rejected_by_settings_when_the_schema_is_bypassed(
    tmp_path: Path, no_kvroute_env: None
) -> None:
    unchecked = chart_copy(tmp_path, schema=False, dashboards={})
    docs = render({"config": {"polcy": "cost"}}, chart=unchecked)
    assert config_file(docs)["polcy"] == "cost"  # it got into the file ...
    with pytest.raises(ValidationError, match="polcy"):  # ... and kvroute refuses it
        router_settings(docs, tmp_path / "mounts")


@pytest.mark.parametrize("kind", ["k8s", "dns"])
def test_a_discovery_kind_without_its_section_fails_helm_template(kind: str) -> None:
    """Settings refuses it (the router would exit at start): so does the chart's schema."""
    with pytest.raises(ValidationError, match=f"discovery.{kind} is not set"):
        Settings.model_validate({"discovery": {"kind": kind}})
    with pytest.raises(helm.HelmValuesError, match=kind):
        render({"config": {"discovery": {"kind": kind}}})
    with pytest.raises(helm.HelmValuesError, match=kind):
        render({"config": {"discovery": {"kind": kind, kind: None}}})


def test_kubernetes_discovery_without_a_label_selector_fails_helm_template() -> None:
    with pytest.raises(helm.HelmValuesError, match="label_selector"):
        render({"config": {"discovery": {"kind": "k8s", "k8s": {"events_port": 5557}}}})


def test_a_bare_yaml_on_turns_the_access_log_on(tmp_path: Path, no_kvroute_env: None) -> None:
    docs = render({"config": {"proxy": {"access_log": True}}})  # YAML `access_log: on`
    assert router_settings(docs, tmp_path).proxy.access_log == "on"


def test_a_typo_in_a_top_level_value_fails_helm_template() -> None:
    with pytest.raises(helm.HelmValuesError, match="replicaCont"):
        render({"replicaCont": 3})
    with pytest.raises(helm.HelmValuesError, match="enabeld"):
        render({"redis": {"enabeld": True}})


def test_a_config_change_rolls_the_router_pods() -> None:
    def checksum(values: dict[str, Any]) -> str:
        deployment = one(render(values), "Deployment")
        return str(deployment["spec"]["template"]["metadata"]["annotations"]["checksum/config"])

    assert checksum({}) == checksum({})
    assert checksum({}) != checksum({"config": {"policy": "least_load"}})


def test_large_numbers_reach_the_config_file_as_integers(
    tmp_path: Path, no_kvroute_env: None
) -> None:
    # Helm holds numbers as float64; printed with %v, 10000000 would become "1e+07"
    docs = render({"config": {"index_capacity": 20_000_000, "proxy": {"max_body_bytes": 2**25}}})
    assert config_file(docs)["index_capacity"] == 20_000_000
    settings = router_settings(docs, tmp_path)
    assert settings.index_capacity == 20_000_000 and settings.proxy.max_body_bytes == 2**25


# -- RBAC: only kubernetes discovery talks to the API server -----------------------------------


def _discovery_kind(values: dict[str, Any]) -> str:
    return str(values.get("config", {}).get("discovery", {}).get("kind", "static"))


@pytest.mark.parametrize("mode", [m for m in MODES if _discovery_kind(MODES[m]) != "k8s"])
def test_no_rbac_and_no_api_token_without_kubernetes_discovery(mode: str) -> None:
    docs = render(MODES[mode])
    assert of_kind(docs, "Role") == [] and of_kind(docs, "RoleBinding") == []
    assert of_kind(docs, "ClusterRole") == [] and of_kind(docs, "ClusterRoleBinding") == []
    for deployment in of_kind(docs, "Deployment"):
        assert deployment["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


def test_kubernetes_discovery_may_list_and_watch_pods_and_nothing_else() -> None:
    docs = render(MODES["kubernetes discovery"])
    (role,) = of_kind(docs, "Role")
    (binding,) = of_kind(docs, "RoleBinding")
    assert role["metadata"]["namespace"] == NAMESPACE
    # router/fleet/discovery.py K8sDiscovery: GET .../pods?labelSelector (list) and ?watch=1
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    deployment = one(docs, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": pod["serviceAccountName"], "namespace": NAMESPACE}
    ]
    assert pod["automountServiceAccountToken"] is True
    (sa,) = of_kind(docs, "ServiceAccount")
    assert sa["metadata"]["name"] == pod["serviceAccountName"]


def test_watching_another_namespace_grants_the_role_there() -> None:
    values = copy.deepcopy(MODES["kubernetes discovery"])
    values["config"]["discovery"]["k8s"]["namespace"] = "vllm"
    docs = render(values)
    (role,) = of_kind(docs, "Role")
    (binding,) = of_kind(docs, "RoleBinding")
    assert role["metadata"]["namespace"] == binding["metadata"]["namespace"] == "vllm"
    assert binding["subjects"][0]["namespace"] == NAMESPACE


def test_the_indexer_discovers_pods_with_the_same_grant() -> None:
    values = {**MODES["kubernetes discovery"], "redis": {"enabled": True}}
    docs = render(values)
    (binding,) = of_kind(docs, "RoleBinding")
    indexer = one(docs, "Deployment", "indexer")["spec"]["template"]["spec"]
    assert indexer["serviceAccountName"] == binding["subjects"][0]["name"]
    assert indexer["automountServiceAccountToken"] is True


# -- Redis and the indexer ----------------------------------------------------------------------


def test_without_redis_there_is_no_redis_and_no_indexer(
    tmp_path: Path, no_kvroute_env: None
) -> None:
    docs = render({})
    assert [
        d["metadata"]["labels"]["app.kubernetes.io/component"] for d in of_kind(docs, "Deployment")
    ] == ["router"]
    assert router_settings(docs, tmp_path).redis_url is None


def test_an_external_redis_is_what_routers_and_indexer_use(
    tmp_path: Path, no_kvroute_env: None
) -> None:
    docs = render(MODES["redis external"])
    url = "redis://valkey.cache.svc:6379/0"
    assert not [
        d for d in docs if d["metadata"]["labels"]["app.kubernetes.io/component"] == "redis"
    ]
    settings = router_settings(docs, tmp_path / "router")
    assert settings.redis_url == url and settings.index_writer is False  # routers only read
    assert one(docs, "Deployment")["spec"]["replicas"] == 3
    indexer = one(docs, "Deployment", "indexer")
    assert indexer["spec"]["replicas"] == 1
    # the new pod waits as a standby (writer lease) until the old one gives the lease up
    assert indexer["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    argv = argv_in(docs, indexer, tmp_path / "indexer")
    assert argv[:2] == ["kvroute", "index"]
    from router.indexer.main import _parser

    args, rest = _parser().parse_known_args(argv[2:])
    assert Settings.load(rest, env_config=False).redis_url == url
    assert args.metrics_host == "0.0.0.0"
    assert args.lease_seconds == 15
    (metrics,) = container(indexer)["ports"]
    assert metrics["containerPort"] == args.metrics_port
    assert container(indexer)["readinessProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}
    (svc,) = [
        s
        for s in of_kind(docs, "Service")
        if s["metadata"]["labels"]["app.kubernetes.io/component"] == "indexer"
    ]
    assert svc["spec"]["ports"][0]["name"] == "metrics"


def test_indexer_standbys_and_the_lease_are_values(tmp_path: Path, no_kvroute_env: None) -> None:
    values = copy.deepcopy(MODES["redis external"])
    values["indexer"] = {"replicas": 2, "leaseSeconds": 6}
    docs = render(values)
    indexer = one(docs, "Deployment", "indexer")
    assert indexer["spec"]["replicas"] == 2
    from router.indexer.main import _parser

    args, _ = _parser().parse_known_args(argv_in(docs, indexer, tmp_path)[2:])
    assert args.lease_seconds == 6
    for key in ("replicas", "leaseSeconds"):
        with pytest.raises(helm.HelmValuesError, match=key):
            render({**values, "indexer": {key: 0}})


def test_the_bundled_valkey_is_what_the_config_points_at(
    tmp_path: Path, no_kvroute_env: None
) -> None:
    docs = render(MODES["redis bundled + indexer"])
    service = one(docs, "Service", "redis")
    valkey = one(docs, "Deployment", "redis")
    settings = router_settings(docs, tmp_path)
    assert settings.redis_url == f"redis://{service['metadata']['name']}:6379/0"
    assert service["spec"]["ports"][0]["port"] == 6379
    assert (
        service["spec"]["selector"].items()
        <= valkey["spec"]["template"]["metadata"]["labels"].items()
    )
    args = container(valkey)["args"]
    # docs/redis.md: evicting index keys would make lookups under-count
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    assert container(valkey)["securityContext"]["readOnlyRootFilesystem"] is True
    assert valkey["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    assert one(docs, "Deployment", "indexer")


def test_redis_with_neither_indexer_nor_writing_router_fails_with_the_reason() -> None:
    with pytest.raises(helm.HelmRenderError, match="nothing writes the index"):
        render({"redis": {"enabled": True}, "indexer": {"enabled": False}})


def test_two_index_writers_fail_with_the_reason() -> None:
    with pytest.raises(helm.HelmRenderError, match="two processes would write"):
        render({"redis": {"enabled": True}, "config": {"index_writer": True}})
    with pytest.raises(helm.HelmRenderError, match="exactly one router replica"):
        render(
            {
                "redis": {"enabled": True},
                "indexer": {"enabled": False},
                "replicaCount": 2,
                "config": {"index_writer": True},
            }
        )


def test_bundled_and_external_redis_together_fail() -> None:
    with pytest.raises(helm.HelmRenderError, match="choose one"):
        render({"redis": {"enabled": True, "url": "redis://elsewhere:6379/0"}})


# -- secrets and pass-through settings ------------------------------------------------------------


def test_secrets_reach_the_env_vars_settings_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_kvroute_env: None
) -> None:
    docs = render(
        {
            "apiKeys": {"existingSecret": "router-keys", "key": "keys"},
            "redis": {"existingSecret": "redis-auth", "existingSecretKey": "url"},
        }
    )
    for deployment in (one(docs, "Deployment"), one(docs, "Deployment", "indexer")):
        env = {e["name"]: e for e in container(deployment)["env"]}
        assert env["KVROUTE_API_KEYS"]["valueFrom"] == {
            "secretKeyRef": {"name": "router-keys", "key": "keys"}
        }
        assert env["KVROUTE_REDIS_URL"]["valueFrom"] == {
            "secretKeyRef": {"name": "redis-auth", "key": "url"}
        }
    assert "redis_url" not in config_file(docs)  # the password stays out of the ConfigMap
    # the Secrets' values, as kubelet would export them: Settings reads these very names
    monkeypatch.setenv("KVROUTE_API_KEYS", '["sk-one", "sk-two"]')
    monkeypatch.setenv("KVROUTE_REDIS_URL", "redis://:pw@redis:6379/0")
    settings = router_settings(docs, tmp_path)
    assert settings.api_keys == ["sk-one", "sk-two"]
    assert settings.redis_url == "redis://:pw@redis:6379/0"


def test_pod_placement_env_annotations_and_pull_secrets_pass_through() -> None:
    values = {
        "extraEnv": [{"name": "KVROUTE_LOG_LEVEL", "value": "debug"}],
        "nodeSelector": {"pool": "cpu"},
        "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}},
        "podAnnotations": {"example.com/team": "serving"},
        "imagePullSecrets": [{"name": "regcred"}],
        "image": {"repository": "registry.local/kvroute", "tag": "0.1.0-rc1"},
    }
    deployment = one(render(values), "Deployment")
    pod = deployment["spec"]["template"]
    assert pod["metadata"]["annotations"]["example.com/team"] == "serving"
    assert pod["spec"]["nodeSelector"] == values["nodeSelector"]
    assert pod["spec"]["tolerations"] == values["tolerations"]
    assert pod["spec"]["affinity"] == values["affinity"]
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
    c = container(deployment)
    assert {"name": "KVROUTE_LOG_LEVEL", "value": "debug"} in c["env"]
    assert c["image"] == "registry.local/kvroute:0.1.0-rc1"


def test_containers_run_non_root_on_a_read_only_root_filesystem() -> None:
    docs = render(MODES["redis bundled + indexer"])
    for deployment in of_kind(docs, "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        c = container(deployment)
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert c["securityContext"]["readOnlyRootFilesystem"] is True
        assert c["securityContext"]["allowPrivilegeEscalation"] is False
        assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
        assert c["resources"]["requests"]


@pytest.mark.parametrize("config", [{}, {"shutdown_grace_s": 100}], ids=["default", "long"])
def test_a_terminating_router_drains_before_the_kubelet_kills_it(
    config: dict[str, Any], tmp_path: Path, no_kvroute_env: None
) -> None:
    """The pod sleeps (endpoints stop sending it requests), kvroute lets in-flight
    streams finish for shutdown_grace_s, and the kubelet waits for both."""
    values = {"config": config, "terminationGracePeriodSeconds": 120}
    docs = render(values)
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    (sleep,) = container(one(docs, "Deployment"))["lifecycle"]["preStop"]["exec"]["command"][1:]
    drain = int(sleep) + router_settings(docs, tmp_path).shutdown_grace_s
    assert pod["terminationGracePeriodSeconds"] > drain
    defaults = render()
    grace = one(defaults, "Deployment")["spec"]["template"]["spec"]
    assert grace["terminationGracePeriodSeconds"] > 5 + Settings().shutdown_grace_s


def test_a_grace_period_shorter_than_the_drain_fails_with_the_reason() -> None:
    with pytest.raises(helm.HelmRenderError, match="must exceed preStopSleepSeconds"):
        render({"terminationGracePeriodSeconds": 30})
    with pytest.raises(helm.HelmRenderError, match="must exceed preStopSleepSeconds"):
        render({"config": {"shutdown_grace_s": 60}})


def test_the_image_tag_defaults_to_the_app_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert chart["apiVersion"] == "v2"
    assert chart["appVersion"] == project["version"]
    assert container(one(render({}), "Deployment"))["image"] == f"kvroute:{project['version']}"


# -- optional objects ------------------------------------------------------------------------------


def test_service_monitor_is_off_by_default_and_scrapes_metrics_when_on() -> None:
    assert of_kind(render({}), "ServiceMonitor") == []
    docs = render({**MODES["serviceMonitor + prometheusRule on"], "redis": {"enabled": True}})
    (monitor,) = of_kind(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    ports = {e["port"] for e in monitor["spec"]["endpoints"]}
    assert {e["path"] for e in monitor["spec"]["endpoints"]} == {"/metrics"}
    # kvroute's `pod` label names the vLLM pod: it must not become exported_pod
    assert all(e["honorLabels"] is True for e in monitor["spec"]["endpoints"])
    selector = monitor["spec"]["selector"]
    for component, port in (("router", "http"), ("indexer", "metrics")):
        service = one(docs, "Service", component)
        labels = service["metadata"]["labels"]
        assert selector["matchLabels"].items() <= labels.items()
        assert labels["app.kubernetes.io/component"] in selector["matchExpressions"][0]["values"]
        assert port in ports and port in {p["name"] for p in service["spec"]["ports"]}
    redis_labels = one(docs, "Service", "redis")["metadata"]["labels"]
    assert (
        redis_labels["app.kubernetes.io/component"] not in selector["matchExpressions"][0]["values"]
    )


def test_the_prometheus_rule_is_off_by_default_and_carries_the_rules_file_verbatim() -> None:
    assert of_kind(render({}), "PrometheusRule") == []
    docs = render({"prometheusRule": {"enabled": True, "labels": {"release": "prom"}}})
    (rule,) = of_kind(docs, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "prom"
    rules_file = yaml.safe_load((CHART / "rules" / "kvroute-rules.yaml").read_text())
    assert rule["spec"]["groups"] == rules_file["groups"]
    annotations = [
        r["annotations"] for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r
    ]
    assert annotations and any("{{ $labels." in str(a) for a in annotations)  # not templated


def test_hpa_scales_the_router_deployment_and_owns_its_replica_count() -> None:
    assert of_kind(render({}), "HorizontalPodAutoscaler") == []
    docs = render(MODES["hpa on"])
    (hpa,) = of_kind(docs, "HorizontalPodAutoscaler")
    deployment = one(docs, "Deployment")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": deployment["metadata"]["name"],
    }
    assert "replicas" not in deployment["spec"]
    assert hpa["spec"]["minReplicas"] == 2 and hpa["spec"]["maxReplicas"] == 10


def test_pdb_selects_the_router_pods() -> None:
    assert of_kind(render({}), "PodDisruptionBudget") == []
    docs = render(MODES["pdb on"])
    (pdb,) = of_kind(docs, "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1
    pod_labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


def test_notes_warn_when_the_router_would_route_to_the_simulated_fleet() -> None:
    assert "SIMULATED" in notes({})
    assert "SIMULATED" not in notes(MODES["kubernetes discovery"])
    assert "SIMULATED" not in notes({"config": {"fleet": {"enabled": False}}})


# -- Grafana dashboards --------------------------------------------------------------------------

DASHBOARD = json.dumps({"title": "kvroute test", "panels": [], "schemaVersion": 39})


def dashboards_configmaps(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        d
        for d in of_kind(docs, "ConfigMap")
        if d["metadata"]["labels"].get("app.kubernetes.io/component") == "dashboards"
    ]


def test_every_dashboard_json_lands_in_one_configmap_for_the_grafana_sidecar(
    tmp_path: Path,
) -> None:
    chart = chart_copy(tmp_path, dashboards={"routing.json": DASHBOARD, "notes.txt": "no"})
    (cm,) = dashboards_configmaps(render({}, chart=chart))
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["data"] == {"routing.json": DASHBOARD}
    assert json.loads(cm["data"]["routing.json"])["title"] == "kvroute test"


def test_dashboards_can_go_to_the_grafana_namespace(tmp_path: Path) -> None:
    chart = chart_copy(tmp_path, dashboards={"routing.json": DASHBOARD})
    (cm,) = dashboards_configmaps(render({"dashboards": {"namespace": "monitoring"}}, chart=chart))
    assert cm["metadata"]["namespace"] == "monitoring"


def test_dashboards_off_or_none_to_ship_renders_no_configmap(tmp_path: Path) -> None:
    with_one = chart_copy(tmp_path / "a", dashboards={"routing.json": DASHBOARD})
    assert dashboards_configmaps(render(MODES["dashboards off"], chart=with_one)) == []
    empty = chart_copy(tmp_path / "b", dashboards={})
    assert dashboards_configmaps(render({}, chart=empty)) == []


def test_the_charts_own_dashboards_render() -> None:
    shipped = sorted(p.name for p in (CHART / "dashboards").glob("*.json"))
    found = dashboards_configmaps(render({}))
    if not shipped:
        assert found == []
        return
    (cm,) = found
    assert sorted(cm["data"]) == shipped
    for name, text in cm["data"].items():
        json.loads(text)
        assert text == (CHART / "dashboards" / name).read_text()


# -- the schema writer -----------------------------------------------------------------------------


def _strip_titles(node: Any, *, in_properties: bool = False) -> Any:
    """pydantic's schema without its generated ``title`` keys (noise for Helm users)."""
    if isinstance(node, dict):
        return {
            k: _strip_titles(v, in_properties=(k == "properties" and not in_properties))
            for k, v in node.items()
            if in_properties or not (k == "title" and isinstance(v, str))
        }
    if isinstance(node, list):
        return [_strip_titles(v) for v in node]
    return node


def settings_defs() -> dict[str, Any]:
    """The ``$defs`` of values.schema.json: Settings and its sections."""
    schema = _strip_titles(Settings.model_json_schema())
    defs: dict[str, Any] = schema.pop("$defs")
    defs["Settings"] = schema
    return dict(sorted(defs.items()))


def _write_schema() -> None:
    schema = json.loads(SCHEMA.read_text())
    schema["$defs"] = settings_defs()
    SCHEMA.write_text(json.dumps(schema, indent=2, ensure_ascii=False) + "\n")
    print(f"wrote {SCHEMA.relative_to(ROOT)}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--write-schema"]:
        sys.exit("usage: python tests/deploy/test_helm.py --write-schema")
    _write_schema()
