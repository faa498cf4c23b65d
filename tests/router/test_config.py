"""Settings: CLI > KVROUTE_* env > YAML file > defaults; unknown keys are errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from router.config import Settings


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for k in list(os.environ):
        if k.startswith("KVROUTE_"):
            monkeypatch.delenv(k)


def write_yaml(tmp_path: Path, text: str) -> str:
    p = tmp_path / "kvroute.yaml"
    p.write_text(text)
    return str(p)


def test_defaults_are_a_cost_policy_router_on_port_8000() -> None:
    s = Settings.load([])
    assert s.port == 8000
    assert s.policy == "cost"
    assert s.pod_header == "x-kvroute-pod"
    assert s.proxy.retries == 1
    assert s.redis_url is None
    assert s.fleet.pods == 4


def test_yaml_file_sets_nested_sections(tmp_path: Path) -> None:
    f = write_yaml(
        tmp_path,
        "port: 9100\nproxy:\n  read_timeout_s: 7\ndiscovery:\n  static:\n"
        "    - {name: a, url: 'http://127.0.0.1:1', models: [m]}\n",
    )
    s = Settings.load(["--config", f])
    assert s.port == 9100
    assert s.proxy.read_timeout_s == 7
    assert [p.name for p in s.discovery.static] == ["a"]


def test_env_overrides_yaml_and_nests_with_double_underscore(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = write_yaml(tmp_path, "port: 9100\nproxy:\n  read_timeout_s: 7\n")
    monkeypatch.setenv("KVROUTE_PORT", "9200")
    monkeypatch.setenv("KVROUTE_PROXY__READ_TIMEOUT_S", "8")
    s = Settings.load(["--config", f])
    assert s.port == 9200
    assert s.proxy.read_timeout_s == 8


def test_cli_overrides_env_and_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = write_yaml(tmp_path, "port: 9100\npolicy: round_robin\n")
    monkeypatch.setenv("KVROUTE_PORT", "9200")
    s = Settings.load(["--config", f, "--port", "9300", "--proxy.read-timeout-s", "9"])
    assert s.port == 9300
    assert s.proxy.read_timeout_s == 9
    assert s.policy == "round_robin"  # from YAML: nothing above it set the policy


def test_config_file_can_come_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVROUTE_CONFIG", write_yaml(tmp_path, "workers: 3\n"))
    assert Settings.load([]).workers == 3


def test_unknown_yaml_key_is_rejected_by_name(tmp_path: Path) -> None:
    f = write_yaml(tmp_path, "prot: 9100\n")
    with pytest.raises(ValidationError, match="prot"):
        Settings.load(["--config", f])


def test_unknown_nested_key_is_rejected(tmp_path: Path) -> None:
    f = write_yaml(tmp_path, "proxy:\n  retry: 2\n")
    with pytest.raises(ValidationError, match="retry"):
        Settings.load(["--config", f])


def test_unknown_cli_flag_exits_with_usage_error() -> None:
    with pytest.raises(SystemExit):
        Settings.load(["--no-such-flag", "1"])


def test_missing_config_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nope\.yaml"):
        Settings.load(["--config", str(tmp_path / "nope.yaml")])


def test_unknown_policy_is_rejected_with_the_available_names() -> None:
    with pytest.raises(ValidationError, match=r"available: .*cost"):
        Settings.load(["--policy", "fastest"])


def test_invalid_values_are_rejected() -> None:
    with pytest.raises(ValidationError, match="read_timeout_s"):
        Settings.load(["--proxy.read-timeout-s", "-1"])
    with pytest.raises(ValidationError, match="header"):
        Settings(pod_header="bad header")


def test_list_and_dict_settings_from_cli_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVROUTE_API_KEYS", '["k1","k2"]')
    s = Settings.load(["--block-sizes", '{"m": 32}', "--max-model-len", '{"m": 4096}'])
    assert s.api_keys == ["k1", "k2"]
    assert s.block_size_for("m") == 32
    assert s.block_size_for("other") is None
    assert s.max_model_len == {"m": 4096}


def test_settings_round_trip_through_json_for_worker_processes() -> None:
    s = Settings.load(["--port", "9300", "--policy-params", '{"seed": 3}'])
    again = Settings.model_validate_json(s.model_dump_json())
    assert again == s


def test_docs_config_table_lists_every_setting_as_the_model_does() -> None:
    from router.config import config_rows, config_table

    doc = (Path(__file__).parents[2] / "docs" / "config.md").read_text()
    assert config_table() in doc, "docs/config.md is stale: run `python -m router.config`"
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    assert config_table() in readme, (
        "README.md's config table is stale: paste `python -m router.config`"
    )
    names = [r[0] for r in config_rows()]
    assert {"port", "proxy.read_timeout_s", "events.mode", "discovery.static"} <= set(names)


@pytest.mark.parametrize("spelled", ["sk-1,sk-2", " sk-1 , sk-2 ", '["sk-1", "sk-2"]'])
def test_list_settings_from_env_vars_are_json_or_comma_separated(
    spelled: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVROUTE_API_KEYS", spelled)
    monkeypatch.setenv("KVROUTE_PROXY__PASSTHROUGH_PATHS", "/tokenize,/rerank")
    s = Settings.load([])
    assert s.api_keys == ["sk-1", "sk-2"]
    assert s.proxy.passthrough_paths == ["/tokenize", "/rerank"]


def test_a_writing_router_with_several_workers_is_refused_naming_both_settings() -> None:
    with pytest.raises(ValueError, match="index_writer with workers=2"):
        Settings.load(["--redis-url", "redis://127.0.0.1:1", "--index-writer", "--workers", "2"])
    assert Settings.load(["--workers", "2"]).workers == 2  # reading workers are fine
