"""Build a policy by name from a dict of parameters (validated strictly)."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from scoring.policies.base import Policy

#: policy name -> module under scoring.policies defining exactly one Policy subclass
_MODULES: dict[str, str] = {
    "round_robin": "scoring.policies.round_robin",
    "least_load": "scoring.policies.least_load",
    "session": "scoring.policies.session",
    "approx_prefix": "scoring.policies.approx_prefix",
    "precise_prefix": "scoring.policies.precise_prefix",
    "cost": "scoring.policies.cost",
    "dynamo": "scoring.policies.dynamo",
    "llmd": "scoring.policies.llmd",
    "measured": "scoring.policies.measured",
}


class PolicyConfigError(ValueError):
    """An unknown policy name or an invalid parameter; the message names it."""


def available_policies() -> list[str]:
    return list(_MODULES)


def policy_class(name: str) -> type[Policy]:
    try:
        module = importlib.import_module(_MODULES[name])
    except KeyError:
        raise PolicyConfigError(
            f"unknown policy {name!r}; available: {', '.join(_MODULES)}"
        ) from None
    for obj in vars(module).values():
        if isinstance(obj, type) and issubclass(obj, Policy) and getattr(obj, "name", None) == name:
            return obj
    raise PolicyConfigError(f"module {_MODULES[name]} defines no policy named {name!r}")


def build_policy(name: str, params: Mapping[str, Any] | None = None) -> Policy:
    cls = policy_class(name)
    try:
        validated = cls.Params.model_validate(dict(params or {}))
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '<params>'}: {err['msg']}"
            for err in exc.errors()
        )
        if any(err["type"] == "extra_forbidden" for err in exc.errors()):
            known = ", ".join(cls.Params.model_fields) or "none"
            problems += f" (parameters of {name!r}: {known})"
        raise PolicyConfigError(f"invalid parameters for policy {name!r}: {problems}") from None
    return cls(validated)
