"""The ``$defs`` of the chart's ``values.schema.json`` (the schema of ``config:``),
generated from kvroute's Settings model; no Helm needed
(``python tests/deploy/test_helm.py --write-schema`` writes them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from router.config import Settings

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kvroute"
SCHEMA = CHART / "values.schema.json"


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


def write_schema() -> None:
    """Rewrite the ``$defs`` of values.schema.json from the Settings model."""
    schema = json.loads(SCHEMA.read_text())
    schema["$defs"] = settings_defs()
    SCHEMA.write_text(json.dumps(schema, indent=2, ensure_ascii=False) + "\n")
    print(f"wrote {SCHEMA.relative_to(ROOT)}")
