"""RBAC in the chart: only Kubernetes discovery talks to the API server, with a grant
to list and watch pods and nothing else."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.deploy.helm_chart import (
    MODES,
    NAMESPACE,
    of_kind,
    one,
    render,
)

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
    # router/fleet/k8s.py K8sDiscovery: GET .../pods?labelSelector (list) and ?watch=1
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
