"""Building blocks the configuration's sections share: a section that forbids unknown
keys, a list of names that ``KVROUTE_*`` variables may spell ``a,b,c``, and the schema
of an ``off`` / ``on`` switch."""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict
from pydantic_settings import NoDecode


class Section(BaseModel):
    """A section of the settings: an unknown key is an error, never a silent default."""

    model_config = ConfigDict(extra="forbid")


def _names(value: Any) -> Any:
    """A list of names from an env var: JSON (``["a", "b"]``) or comma-separated."""
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            return json.loads(text)
        return [part.strip() for part in text.split(",") if part.strip()]
    return value


#: a list of strings that ``KVROUTE_*`` env vars may also spell ``a,b,c``
Names = Annotated[list[str], NoDecode, BeforeValidator(_names)]


def on_off_schema(schema: dict[str, Any]) -> None:
    """``off`` / ``on`` or a boolean: YAML 1.1 (Helm's too) reads a bare off / on as one."""
    schema["anyOf"] = [
        {"enum": schema.pop("enum"), "type": schema.pop("type")},
        {"type": "boolean"},
    ]
