"""The chart's optional objects (ServiceMonitor, PrometheusRule, HPA, PDB), the notes,
and the Grafana dashboards' ConfigMaps."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.helm_chart import (
    CHART,
    MODES,
    chart_copy,
    notes,
    of_kind,
    one,
    render,
)

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
