"""The production image (``docker/Dockerfile``), checked without a container engine.

This machine has a docker client but no daemon and no registry access, so the image is
never built here.  What can be checked is: what the build copies exists and is not
dropped by ``.dockerignore``, the copied tree is everything the wheel is built from, the
base is a slim Python 3.11 pinned by digest, pip installs only pinned wheels
(docker/constraints.txt, checked in test_constraints.py) through a cache mount, the OCI
labels agree with pyproject.toml, the final stage runs as non-root, the ENTRYPOINT is
kvroute's console script and the CMD parses with kvroute's own settings loader, the port
agrees with EXPOSE and with the Helm chart, and the HEALTHCHECK command (stdlib only)
tells a healthy router from a sick or absent one.
"""

from __future__ import annotations

import ast
import fnmatch
import http.server
import json
import os
import re
import shlex
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml

from router.cli import _COMMANDS
from router.config import Settings

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


@dataclass
class Instruction:
    keyword: str  # upper case
    flags: dict[str, str]  # --from=build, --mount=...
    args: str  # the rest, continuation lines joined

    def exec_form(self) -> list[str]:
        value = json.loads(self.args)
        assert isinstance(value, list) and all(isinstance(v, str) for v in value), self.args
        return value


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def last(self, keyword: str) -> Instruction:
        found = self.all(keyword)
        assert found, f"stage {self.name or self.base}: no {keyword}"
        return found[-1]


def instructions(text: str) -> Iterator[Instruction]:
    """Dockerfile instructions: comments dropped, ``\\`` continuations joined."""
    logical = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not logical and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            logical += line[:-1] + " "
            continue
        logical += line
        keyword, _, rest = logical.partition(" ")
        flags: dict[str, str] = {}
        rest = rest.strip()
        while rest.startswith("--"):
            flag, _, rest = rest.partition(" ")
            name, _, value = flag[2:].partition("=")
            flags[name] = value
            rest = rest.strip()
        yield Instruction(keyword.upper(), flags, rest)
        logical = ""


def global_args() -> dict[str, str]:
    """The ARGs before the first FROM, with their defaults (they parameterise FROM, and
    a stage that redeclares one gets its default)."""
    args: dict[str, str] = {}
    for ins in instructions(DOCKERFILE.read_text()):
        if ins.keyword == "FROM":
            break
        if ins.keyword == "ARG":
            name, _, default = ins.args.partition("=")
            args[name] = default
    return args


def expand(text: str, args: dict[str, str]) -> str:
    for name, value in args.items():
        text = text.replace("${" + name + "}", value).replace("$" + name, value)
    return text


def stages() -> list[Stage]:
    args = global_args()
    out: list[Stage] = []
    for ins in instructions(DOCKERFILE.read_text()):
        if ins.keyword == "FROM":
            words = ins.args.split()
            alias = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            out.append(Stage(expand(words[0], args), alias))
        elif out:
            out[-1].instructions.append(ins)
    return out


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern as a regex (Go's filepath.Match plus ``**``: ``*`` and
    ``?`` stay within one path element, ``**`` spans any number)."""
    out = ""
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def dockerignored(path: str) -> bool:
    """Whether ``.dockerignore`` keeps ``path`` out of the build context.  Docker's rule:
    a pattern applies when it matches the path or one of its parent directories; the
    last pattern that applies wins; ``!`` re-includes."""
    patterns = [
        line.strip()
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]
    parts = Path(path).parts
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negated = pattern.startswith("!")
        regex = _pattern_regex(pattern.lstrip("!").strip("/"))
        if any(regex.match(prefix) for prefix in prefixes):
            excluded = not negated
    return excluded


def copies(stage: Stage) -> list[tuple[list[str], str]]:
    """(sources, destination) of each COPY/ADD from the build context."""
    out = []
    for ins in stage.instructions:
        if ins.keyword in ("COPY", "ADD") and "from" not in ins.flags:
            *sources, dest = shlex.split(ins.args)
            out.append((sources, dest))
    return out


FINAL = stages()[-1]


# -- the build ---------------------------------------------------------------------------------


def test_the_build_is_multi_stage_and_ends_in_slim_python_311() -> None:
    all_stages = stages()
    assert len(all_stages) >= 2
    assert FINAL.base.startswith("python:3.11-slim"), FINAL.base
    assert all(s.base.startswith("python:3.11") for s in all_stages)


def test_the_dockerfile_asks_for_the_dockerfile_1_frontend() -> None:
    # BuildKit's syntax line: RUN --mount (the cache and the wheels' bind mount) is part
    # of the stable Dockerfile 1 syntax
    assert DOCKERFILE.read_text().splitlines()[0] == "# syntax=docker/dockerfile:1"


def test_every_stage_starts_from_one_python_image_pinned_by_digest() -> None:
    bases = {s.base for s in stages()}
    assert len(bases) == 1, bases
    (base,) = bases
    assert re.fullmatch(r"python:3\.11-slim-[a-z]+@sha256:[0-9a-f]{64}", base), base


def labels(stage: Stage) -> dict[str, str]:
    """The stage's LABELs, its ARGs expanded with their global defaults."""
    args = global_args()
    out = {}
    for ins in stage.all("LABEL"):
        for word in shlex.split(ins.args):
            key, _, value = word.partition("=")
            out[key] = expand(value, args)
    return out


def test_the_image_carries_oci_labels_that_agree_with_pyproject_and_the_base() -> None:
    oci = {
        k.removeprefix("org.opencontainers.image."): v
        for k, v in labels(FINAL).items()
        if k.startswith("org.opencontainers.image.")
    }
    project = PYPROJECT["project"]
    assert oci["title"] == project["name"]
    assert oci["description"] == project["description"]
    assert oci["version"] == project["version"]  # bump both, or the label lies
    assert oci["licenses"] == project["license"]["text"]
    assert f"{oci['base.name']}@{oci['base.digest']}" == FINAL.base
    assert oci["revision"]  # the commit, set by the release build (--build-arg REVISION)


def pip_runs(stage: Stage) -> list[Instruction]:
    return [i for i in stage.all("RUN") if re.search(r"\bpip (install|wheel)\b", i.args)]


def test_the_build_downloads_through_a_pip_cache_mount() -> None:
    build = stages()[0]
    assert pip_runs(build)
    for run in pip_runs(build):
        assert run.flags.get("mount") == "type=cache,target=/root/.cache/pip", run.args
    # PIP_NO_CACHE_DIR would leave the mounted cache unused
    assert not any("PIP_NO_CACHE_DIR" in e.args for e in build.all("ENV"))


def test_the_build_installs_only_pinned_wheels() -> None:
    build = stages()[0]
    copied = [dest for srcs, dest in copies(build) if "docker/constraints.txt" in srcs]
    assert copied == ["docker/constraints.txt"]
    first_run = next(i for i, ins in enumerate(build.instructions) if ins.keyword == "RUN")
    first_copy = next(
        i
        for i, ins in enumerate(build.instructions)
        if ins.keyword == "COPY" and "docker/constraints.txt" in ins.args
    )
    assert first_copy < first_run
    for run in pip_runs(build):
        assert "-c docker/constraints.txt" in run.args, run.args
        assert "--only-binary=:all:" in run.args, run.args  # no compiler in the image
    # the build backend comes from the pins too, not from an unpinned isolated build env
    assert any("setuptools wheel" in r.args for r in pip_runs(build))
    assert any("--no-build-isolation" in r.args for r in pip_runs(build))


def test_every_copy_source_exists_and_reaches_the_build_context() -> None:
    sources = [s for stage in stages() for srcs, _ in copies(stage) for s in srcs]
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
        assert not dockerignored(source.rstrip("/")), f"COPY {source}: excluded by .dockerignore"


def test_the_build_copies_everything_the_wheel_is_built_from() -> None:
    build = stages()[0]
    copied = {s.rstrip("/") for srcs, _ in copies(build) for s in srcs}
    assert "pyproject.toml" in copied
    assert PYPROJECT["project"]["readme"] in copied  # setuptools reads it for the metadata
    for pattern in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]:
        packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}
        matching = {p for p in packages if fnmatch.fnmatchcase(p, pattern)}
        assert matching and matching <= copied, (pattern, matching, copied)
    assert any("pip wheel" in i.args and " ." in i.args for i in build.all("RUN"))


def test_the_build_context_leaves_tests_and_git_out() -> None:
    for path in ("tests", "tests/fixtures/vllm_events/manifest.json", ".git", "docs", "helm"):
        assert dockerignored(path), path
    assert dockerignored("router/__pycache__/app.cpython-311.pyc")
    assert not dockerignored("router/proxy/app.py")


def test_the_final_stage_installs_wheels_only_and_carries_no_build_tools() -> None:
    runs = " ".join(i.args for i in FINAL.all("RUN"))
    assert "--no-index" in runs  # only the wheels built in the first stage
    # kvroute alone: the plot extra (matplotlib) is an offline analysis tool
    assert re.search(r"--find-links=/wheels kvroute(\s|$)", runs), runs
    for tool in ("gcc", "build-essential", "make ", "g++", "apt-get install"):
        assert tool not in runs, tool
    assert copies(FINAL) == []  # no sources in the runtime image


def test_the_image_runs_as_a_numeric_non_root_user() -> None:
    user = FINAL.last("USER").args
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, user  # numeric: runAsNonRoot can verify it
    chart = yaml.safe_load((ROOT / "helm" / "kvroute" / "values.yaml").read_text())
    assert chart["podSecurityContext"]["runAsUser"] == int(uid)


# -- what it runs --------------------------------------------------------------------------------


def test_the_entrypoint_is_kvroutes_console_script() -> None:
    entrypoint = FINAL.last("ENTRYPOINT").exec_form()
    assert len(entrypoint) == 1
    target = PYPROJECT["project"]["scripts"][entrypoint[0]]
    module, _, func = target.partition(":")
    assert callable(getattr(__import__(module, fromlist=[func]), func))


def test_the_cmd_parses_with_kvroutes_own_settings_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KVROUTE_"):
            monkeypatch.delenv(name)
    command, *argv = FINAL.last("CMD").exec_form()
    assert command == "serve" and command in _COMMANDS
    settings = Settings.load(argv, env_config=False)
    assert settings.host == "0.0.0.0"  # reachable from outside the container
    exposed = [int(p.split("/")[0]) for p in FINAL.last("EXPOSE").args.split()]
    assert exposed == [settings.port]


def test_the_image_port_is_the_charts_container_port() -> None:
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk is not installed")
    with helm.Chart.load(ROOT / "helm" / "kvroute") as chart:
        out = chart.render({}, name="kv", namespace="serving")
    deployment = next(
        d
        for path, text in out.items()
        if path.endswith("deployment.yaml")
        for d in yaml.safe_load_all(text)
        if d and d["kind"] == "Deployment"
    )
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    (port,) = c["ports"]
    exposed = int(FINAL.last("EXPOSE").args.split("/")[0])
    assert port["containerPort"] == exposed
    # the chart keeps the image's console script
    assert c["command"] == FINAL.last("ENTRYPOINT").exec_form()


# -- the HEALTHCHECK --------------------------------------------------------------------------


def healthcheck() -> tuple[dict[str, str], list[str]]:
    ins = FINAL.last("HEALTHCHECK")
    assert ins.args.startswith("CMD ")
    return ins.flags, json.loads(ins.args[4:])


def test_the_healthcheck_uses_only_the_standard_library() -> None:
    _, argv = healthcheck()
    assert argv[:2] == ["python", "-c"]
    for node in ast.walk(ast.parse(argv[2])):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        for name in names:
            assert name.split(".")[0] in sys.stdlib_module_names, name
    assert "http://127.0.0.1:8000/health" in argv[2]


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(b'{"status": "ok"}')

    def log_message(self, *args: object) -> None:
        pass


def _run_check(code: str, port: int) -> int:
    code = code.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30).returncode


@pytest.mark.parametrize(("status", "healthy"), [(200, True), (503, False)])
def test_the_healthcheck_passes_only_on_a_2xx_health(status: int, healthy: bool) -> None:
    _, argv = healthcheck()
    handler = type("Handler", (_Health,), {"status": status})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        code = _run_check(argv[2], server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    assert (code == 0) is healthy


def test_the_healthcheck_fails_when_nothing_listens() -> None:
    _, argv = healthcheck()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    port = server.server_address[1]
    server.server_close()  # the port is now closed
    assert _run_check(argv[2], port) != 0


def test_the_healthcheck_times_out_before_docker_gives_up() -> None:
    flags, argv = healthcheck()
    assert "timeout=2" in argv[2] and flags["timeout"] == "3s"
