"""Redis and the indexer in the chart: external or bundled Redis, one index writer
(the indexer or a writing router), the lease and standbys."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from router.config import Settings
from tests.deploy.helm_chart import (
    MODES,
    argv_in,
    container,
    helm,
    of_kind,
    one,
    render,
    router_settings,
)

# -- Redis and the indexer ----------------------------------------------------------------------


def test_without_redis_there_is_no_redis_and_no_indexer(
    tmp_path: Path, no_kvroute_env: None
) -> None:
    docs = render({})
    assert [
        d["metadata"]["labels"]["app.kubernetes.io/component"] for d in of_kind(docs, "Deployment")
    ] == ["router"]
    assert router_settings(docs, tmp_path).redis_url is None


def test_an_external_redis_is_what_routers_and_indexer_use(
    tmp_path: Path, no_kvroute_env: None
) -> None:
    docs = render(MODES["redis external"])
    url = "redis://valkey.cache.svc:6379/0"
    assert not [
        d for d in docs if d["metadata"]["labels"]["app.kubernetes.io/component"] == "redis"
    ]
    settings = router_settings(docs, tmp_path / "router")
    assert settings.redis_url == url and settings.index_writer is False  # routers only read
    assert one(docs, "Deployment")["spec"]["replicas"] == 3
    indexer = one(docs, "Deployment", "indexer")
    assert indexer["spec"]["replicas"] == 1
    # the new pod waits as a standby (writer lease) until the old one gives the lease up
    assert indexer["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    argv = argv_in(docs, indexer, tmp_path / "indexer")
    assert argv[:2] == ["kvroute", "index"]
    from router.indexer.main import _parser

    args, rest = _parser().parse_known_args(argv[2:])
    assert Settings.load(rest, env_config=False).redis_url == url
    assert args.metrics_host == "0.0.0.0"
    assert args.lease_seconds == 15
    (metrics,) = container(indexer)["ports"]
    assert metrics["containerPort"] == args.metrics_port
    assert container(indexer)["readinessProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}
    (svc,) = [
        s
        for s in of_kind(docs, "Service")
        if s["metadata"]["labels"]["app.kubernetes.io/component"] == "indexer"
    ]
    assert svc["spec"]["ports"][0]["name"] == "metrics"


def test_indexer_standbys_and_the_lease_are_values(tmp_path: Path, no_kvroute_env: None) -> None:
    values = copy.deepcopy(MODES["redis external"])
    values["indexer"] = {"replicas": 2, "leaseSeconds": 6}
    docs = render(values)
    indexer = one(docs, "Deployment", "indexer")
    assert indexer["spec"]["replicas"] == 2
    from router.indexer.main import _parser

    args, _ = _parser().parse_known_args(argv_in(docs, indexer, tmp_path)[2:])
    assert args.lease_seconds == 6
    for key in ("replicas", "leaseSeconds"):
        with pytest.raises(helm.HelmValuesError, match=key):
            render({**values, "indexer": {key: 0}})


def test_the_bundled_valkey_is_what_the_config_points_at(
    tmp_path: Path, no_kvroute_env: None
) -> None:
    docs = render(MODES["redis bundled + indexer"])
    service = one(docs, "Service", "redis")
    valkey = one(docs, "Deployment", "redis")
    settings = router_settings(docs, tmp_path)
    assert settings.redis_url == f"redis://{service['metadata']['name']}:6379/0"
    assert service["spec"]["ports"][0]["port"] == 6379
    assert (
        service["spec"]["selector"].items()
        <= valkey["spec"]["template"]["metadata"]["labels"].items()
    )
    args = container(valkey)["args"]
    # docs/redis.md: evicting index keys would make lookups under-count
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    assert container(valkey)["securityContext"]["readOnlyRootFilesystem"] is True
    assert valkey["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    assert one(docs, "Deployment", "indexer")


def test_redis_with_neither_indexer_nor_writing_router_fails_with_the_reason() -> None:
    with pytest.raises(helm.HelmRenderError, match="nothing writes the index"):
        render({"redis": {"enabled": True}, "indexer": {"enabled": False}})


def test_two_index_writers_fail_with_the_reason() -> None:
    with pytest.raises(helm.HelmRenderError, match="two processes would write"):
        render({"redis": {"enabled": True}, "config": {"index_writer": True}})
    with pytest.raises(helm.HelmRenderError, match="exactly one router replica"):
        render(
            {
                "redis": {"enabled": True},
                "indexer": {"enabled": False},
                "replicaCount": 2,
                "config": {"index_writer": True},
            }
        )


def test_bundled_and_external_redis_together_fail() -> None:
    with pytest.raises(helm.HelmRenderError, match="choose one"):
        render({"redis": {"enabled": True, "url": "redis://elsewhere:6379/0"}})
