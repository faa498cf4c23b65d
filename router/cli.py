"""`kvroute` command line: serve | epp | index | sim | replay | calibrate.

Each subcommand lives in its own module with a ``main(argv)``; this file only
dispatches, importing lazily so `kvroute replay` does not load the web stack.
"""

from __future__ import annotations

import importlib
import sys

_COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("router.proxy.serve", "run the OpenAI-compatible router"),
    "epp": ("router.epp.main", "run as a Gateway API Inference Extension endpoint picker"),
    "index": ("router.indexer.main", "run a KV-event indexer writing into Redis"),
    "sim": ("router.sim.main", "run one simulated vLLM pod"),
    "replay": ("scoring.replay.cli", "replay a trace against simulated pods, per policy"),
    "calibrate": ("router.sim.calibrate", "fit the replay's engine model to a real vLLM engine"),
}


def version() -> str:
    """The installed package's version (``0+unknown`` when run from a bare checkout)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("kvroute")
    except PackageNotFoundError:
        return "0+unknown"


def _usage() -> str:
    lines = ["usage: kvroute COMMAND [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in _COMMANDS.items()]
    lines.append("\n`kvroute COMMAND --help` for a command's options; `kvroute --version`.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if args[0] in ("-V", "--version"):
        print(f"kvroute {version()}")
        return 0
    command, rest = args[0], args[1:]
    if command not in _COMMANDS:
        print(f"kvroute: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(_COMMANDS[command][0])
    result = module.main(rest)
    return int(result or 0)


if __name__ == "__main__":
    raise SystemExit(main())
