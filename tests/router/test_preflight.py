"""A new user's first start: a bad setting is one line naming it (file and line when it
came from YAML) and exit status 2, before anything starts; unknown ``KVROUTE_*``
variables are reported; a router with no usable pod answers 503 saying why."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest

from router import cli
from router.config import Settings
from router.preflight import StartupError, check_settings, load_settings, unknown_env
from router.proxy import serve
from router.proxy.app import create_app
from router.proxy.serve import RunningServer
from tests.support.ports import refused_port


def _yaml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "router.yaml"
    path.write_text(text)
    return str(path)


def _serve_fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[str]:
    """Run `kvroute serve ARGV`: it must exit 2 at once, starting no fleet."""
    before = {t.name for t in threading.enumerate()}
    assert serve.main(argv) == 2
    assert "kvroute-fleet" not in {t.name for t in threading.enumerate()} - before
    err = capsys.readouterr().err.strip().splitlines()
    assert err and all(line.startswith("kvroute serve: ") for line in err)
    assert "Traceback" not in "\n".join(err)
    return err


def test_an_unknown_yaml_key_names_the_setting_the_file_and_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _yaml(tmp_path, "policy: cost\nproxy:\n  retriez: 2\n")
    (line,) = _serve_fails(["--config", config], capsys)
    assert "'proxy.retriez'" in line and f"{config}:3" in line


def test_malformed_yaml_is_one_line_with_its_line_number(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _yaml(tmp_path, "policy: cost\nmodels: [a, b\n")
    (line,) = _serve_fails(["--config", config], capsys)
    assert "not valid YAML" in line and config in line


def test_a_policy_parameter_typo_names_it_and_lists_the_real_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _yaml(tmp_path, "policy: cost\npolicy_params:\n  backlg_weight: 3\n")
    (line,) = _serve_fails(["--config", config], capsys)
    assert "backlg_weight" in line and "backlog_weight" in line and "policy_params" in line


def test_a_missing_tokenizer_directory_names_the_setting(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (line,) = _serve_fails(["--tokenizer", str(tmp_path / "nowhere")], capsys)
    assert "'tokenizer'" in line and "nowhere" in line


@pytest.mark.parametrize("url", ["10.0.0.7:8000", "ftp://10.0.0.7", "http://", "http://:80"])
def test_a_pod_url_without_scheme_and_host_is_refused_at_load(
    url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _yaml(tmp_path, f'discovery:\n  static:\n    - name: a\n      url: "{url}"\n')
    (line,) = _serve_fails(["--config", config], capsys)
    assert "discovery.static.0.url" in line and "http://HOST:PORT" in line
    assert f"{config}:" in line


def test_a_missing_config_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (line,) = _serve_fails(["--config", str(tmp_path / "absent.yaml")], capsys)
    assert "no such file" in line


def test_good_settings_pass_the_checks() -> None:
    settings = load_settings(["--policy", "cost", "--policy-params", '{"backlog_weight": 3}'])
    check_settings(settings)  # raises nothing
    with pytest.raises(StartupError, match=r"'proxy\.retries'"):
        load_settings(["--proxy.retries", "-1"])


def test_unknown_kvroute_variables_are_listed_and_known_ones_are_not() -> None:
    env = {
        "KVROUTE_POLCY": "cost",  # typo
        "KVROUTE_POLICY": "cost",
        "KVROUTE_PROXY__RETRIES": "2",  # nested
        "KVROUTE_TOKENIZERS__my-model": "builtin",  # a dict setting, keyed by model
        "KVROUTE_CONFIG": "router.yaml",  # the file, not a setting
        "KVROUTE_SCRAPE__INTERVALS": "1",  # typo in a nested name
        "OTHER": "x",
    }
    assert unknown_env(env) == ["KVROUTE_POLCY", "KVROUTE_SCRAPE__INTERVALS"]


def test_version_and_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip().startswith("kvroute ")
    with pytest.raises(SystemExit) as stop:
        Settings.load(["--help"])
    assert stop.value.code == 0
    text = capsys.readouterr().out
    assert "--config FILE" in text and "example (router.yaml)" in text


# -- a router with no usable pod --------------------------------------------------------


async def _chat(settings: Settings) -> httpx.Response:
    async with (
        RunningServer(create_app(settings)) as router,
        httpx.AsyncClient(base_url=router.url, timeout=30) as client,
    ):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        return await client.post("/v1/chat/completions", json=body)


async def test_no_pods_discovered_is_a_503_that_says_so() -> None:
    settings = Settings.model_validate({"fleet": {"enabled": False}, "events": {"enabled": False}})
    r = await _chat(settings)
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["code"] == "no_pods" and "no pods discovered" in err["message"]


async def test_pods_that_never_answered_give_a_503_with_the_last_error() -> None:
    url = f"http://127.0.0.1:{refused_port()}"
    settings = Settings.model_validate(
        {
            "discovery": {"static": [{"name": "pod-a", "url": url}]},
            "fleet": {"enabled": False},
            "events": {"enabled": False},
            "health": {"interval_s": 60, "timeout_s": 0.5},
        }
    )
    r = await _chat(settings)
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "no_healthy_pod"
    assert "none of the 1 pods has reported its models" in err["message"]
    assert "pod-a: ConnectError" in err["message"]
