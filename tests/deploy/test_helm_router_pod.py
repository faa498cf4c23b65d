"""The router's pod in the chart: secrets reach the env vars Settings reads, placement
and pull secrets pass through, a non-root read-only container, the drain before the
kubelet kills it, the image tag."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from router.config import Settings
from tests.deploy.helm_chart import (
    CHART,
    MODES,
    ROOT,
    config_file,
    container,
    helm,
    of_kind,
    one,
    render,
    router_settings,
)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")


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
