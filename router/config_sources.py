"""Where the settings of `kvroute serve` come from: CLI flags > ``KVROUTE_*`` env vars >
a YAML file (``--config FILE``) > the defaults, and the CLI's help text.

:meth:`router.config.Settings.load` is the one caller.
"""

from __future__ import annotations

import argparse
from typing import Any, TypeVar

from pydantic_settings import (
    BaseSettings,
    CliSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

S = TypeVar("S", bound=BaseSettings)


def pop_config_flag(args: list[str]) -> tuple[str | None, list[str]]:
    """``--config FILE`` (or ``--config=FILE``) out of ``args``: (the file, the rest)."""
    out: list[str] = []
    config: str | None = None
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--config":
            if i + 1 >= len(args):
                raise ValueError("--config needs a file name")
            config = args[i + 1]
            i += 2
            continue
        if a.startswith("--config="):
            config = a.split("=", 1)[1]
        else:
            out.append(a)
        i += 1
    return config, out


_HELP = """\
The OpenAI-compatible router. Every setting below can also come from a YAML file
(--config FILE, or KVROUTE_CONFIG) or from KVROUTE_* environment variables (nested with
__: KVROUTE_PROXY__RETRIES=2); flags win over the environment, the environment over the
file. With no pods configured, an embedded simulated fleet answers at once.

main settings: --policy (cost), --discovery.static / --discovery.kind (dns, k8s),
--tokenizer (builtin | DIR | remote), --redis-url, --port. All: docs/config.md.
"""

_EXAMPLE = """\
example (router.yaml):
  policy: cost
  tokenizer: /models/Qwen3-8B
  discovery:
    static:
      - {name: pod-a, url: "http://10.0.0.7:8000", events_endpoint: "tcp://10.0.0.7:5557"}
      - {name: pod-b, url: "http://10.0.0.8:8000", events_endpoint: "tcp://10.0.0.8:5557"}

  kvroute serve --config router.yaml --port 8000
"""


def _root_parser() -> argparse.ArgumentParser:
    """The CLI's parser: the help shows ``--config`` (taken out of the arguments before
    the settings are parsed) and an example."""
    parser = argparse.ArgumentParser(
        prog="kvroute serve",
        description=_HELP,
        epilog=_EXAMPLE,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config", metavar="FILE", help="YAML file of settings (also KVROUTE_CONFIG)"
    )
    return parser


def with_sources(base: type[S], cli_args: list[str], yaml_file: str | None) -> type[S]:
    """A subclass of ``base`` whose sources are exactly CLI > env > YAML > defaults."""

    class _Loaded(base):  # type: ignore[valid-type,misc]
        model_config = SettingsConfigDict(**{**base.model_config, "yaml_file": yaml_file})

        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            sources: list[PydanticBaseSettingsSource] = [init_settings]
            cli: CliSettingsSource[Any] = CliSettingsSource(
                settings_cls,
                root_parser=_root_parser(),
                cli_parse_args=cli_args,
                cli_prog_name="kvroute serve",
                cli_kebab_case=True,
                cli_implicit_flags=True,
                cli_exit_on_error=True,
            )
            sources += [cli, env_settings]
            if yaml_file is not None:
                sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=yaml_file))
            return tuple(sources)

    _Loaded.__name__ = base.__name__
    return _Loaded
