"""The chart's README (helm/kvroute/README.md) carries a values table generated from
values.yaml and its comments: it must be current, and name every top-level value."""

from __future__ import annotations

from pathlib import Path

import yaml

from tools.chart_readme import CHART, render


def test_the_chart_readme_is_generated_from_the_current_values() -> None:
    current = (CHART / "README.md").read_text()
    assert current == render(), "helm/kvroute/README.md is stale: python tools/chart_readme.py"


def test_every_top_level_value_has_a_row() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    table = render()
    for key in values:
        assert f"| `{key}" in table, key


def test_chart_yaml_points_artifact_hub_at_the_readme_and_the_license() -> None:
    chart = yaml.safe_load((Path(CHART) / "Chart.yaml").read_text())
    assert chart["name"] == "kvroute" and chart.get("description")
    assert chart["annotations"]["artifacthub.io/license"] == "Apache-2.0"
