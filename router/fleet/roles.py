"""Pod roles for prefill/decode disaggregation: ``prefill``, ``decode`` or ``both``.

A pod's role says which half of a disaggregated request it takes (vLLM's NixlConnector
``kv_role``: ``kv_producer`` = prefill, ``kv_consumer`` = decode, ``kv_both`` = both).
``both`` (the default) is an ordinary pod that serves whole requests, and may also act as
either half.  A role is per model: one pod may prefill model A and decode model B, so a
:class:`~router.fleet.pods.PodSpec` carries a default role and per-model overrides.

Where roles come from (docs/pd.md):

* static discovery: ``role`` (every model) and ``roles: {model: role}`` on a pod;
* DNS discovery: the same two settings on the DNS source (every address gets them);
* Kubernetes: a pod label or annotation, first found among ``role_keys`` (default
  ``kvroute.io/role``, then llm-d's ``llm-d.ai/role``), and per-model overrides in the
  annotation ``kvroute.io/roles`` (``"model-a=prefill,model-b=decode"``).

Values are read as llm-d writes them too: ``prefill``, ``decode``, ``both``, and llm-d's
aggregated ``prefill-decode`` (= ``both``); case and surrounding spaces are ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, get_args

from pydantic import BaseModel, field_validator

Role = Literal["prefill", "decode", "both"]
ROLES: tuple[Role, ...] = get_args(Role)

#: spellings other routers use for the same roles (llm-d's label values)
_ALIASES: dict[str, Role] = {"prefill-decode": "both", "prefill_decode": "both"}


class RoleError(ValueError):
    """A role value that is none of prefill / decode / both (the message names it)."""


def parse_role(raw: str, where: str = "role") -> Role:
    """``raw`` as a :data:`Role`; :class:`RoleError` naming ``where`` otherwise."""
    value = raw.strip().lower()
    if value in ROLES:
        return value
    if value in _ALIASES:
        return _ALIASES[value]
    raise RoleError(f"{where}={raw!r} is not a pod role (prefill, decode, both)")


def parse_role_map(raw: str, where: str = "roles") -> dict[str, Role]:
    """``"model-a=prefill, model-b=decode"`` as ``{model: role}``."""
    out: dict[str, Role] = {}
    for item in raw.split(","):
        if not item.strip():
            continue
        model, sep, value = item.partition("=")
        if not sep or not model.strip():
            raise RoleError(f"{where}: {item.strip()!r} is not MODEL=ROLE")
        out[model.strip()] = parse_role(value, f"{where}[{model.strip()}]")
    return out


def role_overrides(roles: Mapping[str, Role]) -> tuple[tuple[str, Role], ...]:
    """Per-model roles in the hashable, ordered form a PodSpec keeps."""
    return tuple(sorted(roles.items()))


def can_prefill(role: Role) -> bool:
    """Whether a pod of ``role`` may take the prefill half of a split request."""
    return role != "decode"


def can_decode(role: Role) -> bool:
    """Whether a pod of ``role`` may take the decode half (or a whole request)."""
    return role != "prefill"


def role_value(v: object) -> object:
    """A configured ``role`` before validation: llm-d's spellings accepted (a pydantic
    ``mode="before"`` validator; anything but a string is left to the field's type)."""
    return parse_role(v) if isinstance(v, str) else v


def roles_value(v: object) -> object:
    """A configured ``roles: {model: role}`` before validation (see :func:`role_value`)."""
    if isinstance(v, dict):
        return {k: parse_role(r, f"roles[{k}]") if isinstance(r, str) else r for k, r in v.items()}
    return v


class RoleSpelling(BaseModel):
    """A settings model's ``role`` / ``roles`` fields read with llm-d's spellings (the
    fields themselves are the subclass's, with its own descriptions)."""

    @field_validator("role", mode="before", check_fields=False)
    @classmethod
    def _role(cls, v: object) -> object:
        return role_value(v)

    @field_validator("roles", mode="before", check_fields=False)
    @classmethod
    def _roles(cls, v: object) -> object:
        return roles_value(v)
