"""What `kvroute serve` and `kvroute index` check before they start anything.

A bad setting is one line naming the setting, where it came from (the YAML file and
line when known) and what is wrong, and exit status 2 — never a traceback after the
embedded fleet has started:

* :func:`load_settings` turns the config sources' failures (a missing or malformed
  YAML file, an unknown key, a value out of range) into :class:`StartupError`;
* :func:`check_settings` builds what the settings name but the model cannot check on
  its own: the policy with its ``policy_params`` (decoded strictly by the policy) and
  every tokenizer spec;
* :func:`unknown_env` lists ``KVROUTE_*`` variables that name no setting (a typo such
  as ``KVROUTE_POLCY`` is otherwise ignored by the environment source).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from router.config import Settings

#: variables of the process itself, not settings (set by `kvroute serve` for its workers)
_INTERNAL_ENV = frozenset(
    {"KVROUTE_CONFIG", "KVROUTE_SERVE_SETTINGS_JSON", "KVROUTE_METRICS_SHARE_DIR"}
)


class StartupError(Exception):
    """A setting that stops the start; ``str()`` is the line to print."""


def _loc(loc: Sequence[Any]) -> str:
    return ".".join(str(p) for p in loc) or "(settings)"


def _yaml_line(config_file: str | None, loc: Sequence[Any]) -> int | None:
    """The 1-based line of the YAML node at ``loc`` (None: not in the file)."""
    if config_file is None:
        return None
    try:
        node = yaml.compose(Path(config_file).read_text())
    except (OSError, yaml.YAMLError):
        return None
    line: int | None = None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            match = next((v for k, v in node.value if k.value == str(part)), None)
            key = next((k for k, _ in node.value if k.value == str(part)), None)
            if match is None or key is None:
                return line
            line = key.start_mark.line + 1
            node = match
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int):
            if part >= len(node.value):
                return line
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            return line
    return line


def _describe(err: Mapping[str, Any], config_file: str | None) -> str:
    loc = [p for p in err.get("loc", ()) if p not in ("function-after", "function-before")]
    where = _loc(loc)
    line = _yaml_line(config_file, loc)
    origin = f" ({config_file}:{line})" if line is not None else ""
    if err.get("type") == "extra_forbidden":
        return f"unknown setting {where!r}{origin}: check its spelling in docs/config.md"
    msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
    if not loc:  # a check across settings: its message names them
        return msg
    if "input" in err and err.get("type") not in ("missing", "value_error"):
        value = repr(err["input"])
        if len(value) > 60:
            value = value[:57] + "..."
        msg = f"{msg} (got {value})"
    return f"setting {where!r}{origin}: {msg}"


def load_settings(
    argv: Sequence[str] | None, model: type[Settings] = Settings, *, env_config: bool = True
) -> Settings:
    """:meth:`Settings.load`, every failure a :class:`StartupError` (one line per problem)."""
    args = list(argv or [])
    config_file = _config_file(args, env_config)
    try:
        return model.load(args, env_config=env_config)
    except FileNotFoundError as exc:
        raise StartupError(str(exc)) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{config_file}:{mark.line + 1}" if mark is not None else str(config_file)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise StartupError(f"--config {where}: not valid YAML: {problem}") from None
    except ValidationError as exc:
        lines = [_describe(e, config_file) for e in exc.errors()]
        raise StartupError("\n".join(lines)) from None
    except ValueError as exc:
        raise StartupError(str(exc)) from None


def _config_file(args: Sequence[str], env_config: bool) -> str | None:
    for i, a in enumerate(args):
        if a == "--config" and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--config="):
            return a.split("=", 1)[1]
    return (os.environ.get("KVROUTE_CONFIG") or None) if env_config else None


def check_settings(settings: Settings) -> None:
    """Build the policy and load every tokenizer now; :class:`StartupError` naming the
    setting when one fails."""
    from router.tokenize import load_tokenizer
    from scoring.policies import build_policy
    from scoring.policies.registry import PolicyConfigError

    try:
        build_policy(settings.policy, settings.policy_params)
    except PolicyConfigError as exc:
        raise StartupError(f"setting 'policy_params': {exc}") from None
    specs = {"tokenizer": settings.tokenizer}
    specs.update({f"tokenizers.{m}": spec for m, spec in settings.tokenizers.items()})
    for name, spec in specs.items():
        if spec.startswith("remote"):
            continue  # asks the pods at run time
        try:
            load_tokenizer(spec)
        except Exception as exc:  # a path that is not a tokenizer, a broken file...
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise StartupError(
                f"setting {name!r}: cannot load tokenizer {spec!r}: {first} (builtin, approx, "
                "remote or a directory with tokenizer.json)"
            ) from None


def unknown_env(environ: Mapping[str, str] | None = None) -> list[str]:
    """``KVROUTE_*`` names in ``environ`` that are no setting (sorted)."""
    env = os.environ if environ is None else environ
    known = _env_names(Settings, "KVROUTE_")
    return sorted(
        k
        for k in env
        if k.upper().startswith("KVROUTE_")
        and k.upper() not in _INTERNAL_ENV
        and not _known(k.upper(), known)
    )


def _known(name: str, known: set[str]) -> bool:
    # a nested model may be given whole (KVROUTE_PROXY) or field by field
    return name in known or any(name.startswith(k[:-1] + "__") for k in known if k.endswith("*"))


def _env_names(model: type[BaseModel], prefix: str) -> set[str]:
    names: set[str] = set()
    for field, info in model.model_fields.items():
        name = prefix + field.upper()
        names.add(name)
        ann = info.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            names |= _env_names(ann, name + "__")
        elif _dict_like(ann):
            names.add(name + "*")  # KVROUTE_TOKENIZERS__<model> and the like
    return names


def _dict_like(ann: Any) -> bool:
    origin = getattr(ann, "__origin__", None)
    return origin is dict or ann is dict
