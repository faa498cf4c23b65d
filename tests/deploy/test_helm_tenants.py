"""The chart's tenants and Redis security: the tenants Secret (existing or rendered)
reaches the env vars Settings reads, Redis' password and CA are mounted files the
config points at, for the router and the indexer alike."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from tests.deploy.test_helm import (
    config_file,
    container,
    one,
    render,
    router_settings,
)
from tests.deploy.test_helm import no_kvroute_env as no_kvroute_env  # the fixture

KEY = hashlib.sha256(b"tenant-key-0123456789").hexdigest()


def test_a_rendered_tenants_secret_reaches_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_kvroute_env: None
) -> None:
    tenants = [{"name": "team-a", "key_sha256": KEY, "limits": {"requests_per_minute": 60}}]
    docs = render({"tenants": {"list": tenants, "saltSecret": "x" * 40}})
    secret = one(docs, "Secret", "tenants")
    assert json.loads(secret["stringData"]["tenants.json"]) == tenants
    env = {e["name"]: e for e in container(one(docs, "Deployment"))["env"]}
    ref = env["KVROUTE_TENANTS"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": secret["metadata"]["name"], "key": "tenants.json"}
    assert "tenants" not in config_file(docs)  # the keys' digests stay out of the ConfigMap
    monkeypatch.setenv("KVROUTE_TENANTS", secret["stringData"]["tenants.json"])
    monkeypatch.setenv("KVROUTE_TENANT_SALT_SECRET", secret["stringData"]["salt-secret"])
    settings = router_settings(docs, tmp_path)
    assert [t.name for t in settings.tenants] == ["team-a"]
    assert settings.tenants[0].limits.requests_per_minute == 60


def test_an_existing_tenants_secret_is_used_and_nothing_is_rendered() -> None:
    docs = render({"tenants": {"existingSecret": "my-tenants"}})
    assert not [d for d in docs if d["kind"] == "Secret"]
    env = {e["name"]: e for e in container(one(docs, "Deployment"))["env"]}
    assert env["KVROUTE_TENANT_SALT_SECRET"]["valueFrom"]["secretKeyRef"]["name"] == "my-tenants"


def test_tenants_without_a_salt_secret_fail_with_the_reason() -> None:
    with pytest.raises(Exception, match="saltSecret"):
        render({"tenants": {"list": [{"name": "a", "key_sha256": KEY}]}})


def test_redis_password_and_ca_are_mounted_files_for_router_and_indexer() -> None:
    docs = render(
        {
            "redis": {
                "url": "rediss://redis:6380/0",
                "username": "kvroute",
                "passwordSecret": {"name": "redis-auth", "key": "password"},
                "caSecret": {"name": "redis-ca", "key": "ca.crt"},
            }
        }
    )
    config = config_file(docs)
    assert config["redis_password_file"] == "/etc/kvroute-secrets/redis-password"
    assert config["redis_ca_file"] == "/etc/kvroute-secrets/redis-ca.pem"
    assert config["redis_username"] == "kvroute"
    for deployment in (one(docs, "Deployment"), one(docs, "Deployment", "indexer")):
        mounts = {m["name"]: m for m in container(deployment)["volumeMounts"]}
        assert mounts["secrets"]["mountPath"] == "/etc/kvroute-secrets"
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        sources = volumes["secrets"]["projected"]["sources"]
        assert {s["secret"]["name"] for s in sources} == {"redis-auth", "redis-ca"}
