"""The chart's ``config:``: one model for CLI, env and Helm values (its schema is
generated from the Settings model; a key Settings does not know fails)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from router.config import Settings
from tests.deploy.helm_chart import (
    CHART,
    SCHEMA,
    chart_copy,
    config_file,
    helm,
    one,
    render,
    router_settings,
)
from tests.deploy.helm_schema import settings_defs

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
