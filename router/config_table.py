"""The documentation table of a settings model: one Markdown row per leaf setting with
its env var, CLI flag, default, type, meaning and bounds (README's and docs/config.md's
table, written by ``tools/sync_config_table.py``)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, BeforeValidator
from pydantic_settings import NoDecode


def _type_name(annotation: Any) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    return (text or str(annotation).replace("typing.", "")).replace("|", "or")


def _bound(meta: Any) -> str:
    if meta is NoDecode or isinstance(meta, BeforeValidator):  # a Names list
        return "env: JSON or comma-separated" if meta is NoDecode else ""
    for attr, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
        if getattr(meta, attr, None) is not None:
            return f"{op} {getattr(meta, attr)}"
    if getattr(meta, "min_length", None) is not None:
        return f"min length {meta.min_length}"
    return str(meta)


def settings_rows(
    model: type[BaseModel], prefix: tuple[str, ...] = ()
) -> list[tuple[str, str, str, str, str]]:
    """(setting, env var, CLI flag, default, meaning) for every leaf setting."""
    rows: list[tuple[str, str, str, str, str]] = []
    for name, info in model.model_fields.items():
        path = (*prefix, name)
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            rows += settings_rows(ann, path)
            continue
        sub = [a for a in getattr(ann, "__args__", ()) if isinstance(a, type)]
        models = [a for a in sub if issubclass(a, BaseModel)]
        if len(models) == 1 and type(None) in sub:  # an optional section: its fields
            rows.append(
                (
                    ".".join(path),
                    "KVROUTE_" + "__".join(p.upper() for p in path),
                    "--" + ".".join(p.replace("_", "-") for p in path),
                    "`None`",
                    f"optional section; {info.description or ''}".rstrip("; "),
                )
            )
            rows += settings_rows(models[0], path)
            continue
        default = info.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            default = default.model_dump()
        meaning = (info.description or "").replace("|", "\\|")
        if info.metadata:
            bounds = ", ".join(b for b in map(_bound, info.metadata) if b)
            meaning = f"{meaning} ({bounds})" if meaning else bounds
        rows.append(
            (
                ".".join(path),
                "KVROUTE_" + "__".join(p.upper() for p in path),
                "--" + ".".join(p.replace("_", "-") for p in path),
                "required" if info.is_required() else "`" + repr(default).replace("|", "\\|") + "`",
                f"{_type_name(ann)}; {meaning}".rstrip("; ").replace("\n", " "),
            )
        )
    return rows


def settings_table(model: type[BaseModel]) -> str:
    """The Markdown table of every leaf setting of ``model``."""
    lines = [
        "| setting | env var | CLI flag | default | type; meaning |",
        "|---|---|---|---|---|",
    ]
    lines += ["| " + " | ".join(r) + " |" for r in settings_rows(model)]
    return "\n".join(lines) + "\n"
