"""Kubernetes discovery against a fake API server: list then watch, relist on 410 Gone,
garbage watch lines, items without a name, an unreachable server, and the settings'
errors.
"""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from router.fleet.k8s import DiscoveryError, K8sDiscovery, K8sDiscoverySettings
from router.fleet.pods import PodRegistry
from tests.router.discovery_support import (
    FakeApiServer,
    k8s_discovery_running,
    k8s_pod,
    k8s_settings,
)
from tests.support.aio import running, wait_until


def test_missing_api_server_and_namespace_are_named_in_the_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(DiscoveryError, match="KUBERNETES_SERVICE_HOST"):
        K8sDiscovery(K8sDiscoverySettings(namespace="x", label_selector="app=vllm"))
    with pytest.raises(DiscoveryError, match="namespace"):
        K8sDiscovery(
            K8sDiscoverySettings(
                label_selector="app=vllm",
                api_server="http://127.0.0.1:1",
                namespace_file=str(tmp_path / "nope"),
            )
        )
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    ns = tmp_path / "namespace"
    ns.write_text("prod\n")
    disc = K8sDiscovery(K8sDiscoverySettings(label_selector="a=b", namespace_file=str(ns)))
    assert disc.base_url == "https://10.96.0.1:6443"
    assert disc.namespace == "prod"


async def test_k8s_discovery_lists_then_follows_the_watch_stream(tmp_path: Path) -> None:
    api = FakeApiServer()
    api.items = [
        k8s_pod("a", ip="10.0.0.1"),
        k8s_pod("b", ip="10.0.0.2", ready=False),
        k8s_pod("bad", ip="10.0.0.9", annotations={"kvroute.io/port": "x"}),
    ]
    async with k8s_discovery_running(api, tmp_path) as (disc, reg):
        await wait_until(lambda: len(api.watches()) == 1)
        assert [p.name for p in reg.all()] == ["a"]  # b not Ready, bad skipped
        assert "bad" in disc.skipped
        listed = api.lists()[0]
        assert listed["ns"] == "llm"
        assert listed["query"]["labelSelector"] == "app=vllm"
        assert listed["auth"] == "Bearer s3cret-token"
        watch = api.watches()[0]
        assert watch["query"]["resourceVersion"] == "100"
        assert watch["auth"] == "Bearer s3cret-token"

        # b becomes Ready
        await api.watch_queue.put({"type": "MODIFIED", "object": k8s_pod("b", "10.0.0.2")})
        await wait_until(lambda: reg.get("b") is not None)
        assert reg.get("b").spec.url == "http://10.0.0.2:8000"  # type: ignore[union-attr]
        # a is deleted
        await api.watch_queue.put({"type": "DELETED", "object": k8s_pod("a", "10.0.0.1", rv="102")})
        await wait_until(lambda: reg.get("a") is None)
        assert [p.name for p in reg.all()] == ["b"]
        # b loses readiness
        await api.watch_queue.put(
            {"type": "MODIFIED", "object": k8s_pod("b", "10.0.0.2", ready=False, rv="103")}
        )
        await wait_until(lambda: reg.get("b") is None)
        # a bookmark moves the resourceVersion; the stream ends; the next watch resumes
        await api.watch_queue.put(
            {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "150"}}}
        )
        await api.watch_queue.put(None)
        await wait_until(lambda: len(api.watches()) == 2)
        assert api.watches()[1]["query"]["resourceVersion"] == "150"
        assert len(api.lists()) == 1  # resumed, not re-listed


async def test_k8s_discovery_relists_when_the_watch_says_410_gone(tmp_path: Path) -> None:
    api = FakeApiServer()
    api.items = [k8s_pod("a")]
    async with k8s_discovery_running(api, tmp_path) as (disc, reg):
        await wait_until(lambda: len(api.watches()) == 1)
        # while we were not watching, a went away and c came
        api.items = [k8s_pod("c", ip="10.0.0.3")]
        api.list_rv = "200"
        await api.watch_queue.put(
            {"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old"}}
        )
        await wait_until(lambda: disc.relists_on_gone == 1)
        await wait_until(lambda: len(api.watches()) == 2)  # after the re-list
        assert [p.name for p in reg.all()] == ["c"]
        assert api.watches()[1]["query"]["resourceVersion"] == "200"

        # an HTTP 410 answer to the watch request re-lists too
        api.gone_on_next_watch = True
        await api.watch_queue.put(None)
        await wait_until(lambda: disc.relists_on_gone == 2)
        await wait_until(lambda: len(api.lists()) == 3)  # the re-list follows the 410


async def test_k8s_discovery_counts_and_skips_garbage_watch_lines(tmp_path: Path) -> None:
    api = FakeApiServer()
    api.items = [k8s_pod("a")]
    async with k8s_discovery_running(api, tmp_path) as (disc, reg):
        await wait_until(lambda: len(api.watches()) == 1)
        api.watch_queue.put_nowait({"type": "ADDED", "object": k8s_pod("b", "10.0.0.2")})
        await wait_until(lambda: reg.get("b") is not None)
        # a line that is not JSON, or not an event, is counted and skipped
        await api.watch_queue.put("{not json")
        await api.watch_queue.put({"type": "ADDED", "object": "not-a-pod"})
        await api.watch_queue.put({"type": "ADDED", "object": k8s_pod("d", "10.0.0.4")})
        await wait_until(lambda: reg.get("d") is not None)
        assert disc.errors == 2
        assert len(api.watches()) == 1  # the same stream went on


async def test_k8s_discovery_skips_list_items_without_a_name(tmp_path: Path) -> None:
    api = FakeApiServer()
    api.items = [{"metadata": {}}, "garbage", k8s_pod("a")]  # type: ignore[list-item]
    async with k8s_discovery_running(api, tmp_path) as (disc, reg):
        await wait_until(lambda: len(api.watches()) == 1)
        assert [p.name for p in reg.all()] == ["a"]
        assert disc.errors == 2


async def test_k8s_discovery_retries_after_the_api_server_is_unreachable(tmp_path: Path) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    dead_port = sock.getsockname()[1]
    sock.close()  # nothing listens there
    disc = K8sDiscovery(k8s_settings(f"http://127.0.0.1:{dead_port}", tmp_path))
    reg = PodRegistry()
    async with running(disc.run(reg)):
        await wait_until(lambda: disc.errors >= 2)
    assert reg.all() == []
