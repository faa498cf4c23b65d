"""Pod discovery: static list, DNS re-resolution, Kubernetes list + watch.

The Kubernetes tests run a small fake API server (FastAPI on uvicorn, loopback, a free
port) that serves the Pods list and a watch stream of JSON lines the test feeds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from router.fleet.discovery import (
    DiscoveryError,
    DiscoverySettings,
    DnsDiscovery,
    DnsDiscoverySettings,
    K8sDiscovery,
    K8sDiscoverySettings,
    StaticDiscovery,
    build_discovery,
    pod_is_ready,
)
from router.fleet.pods import PodRegistry
from tests.support.aio import running, serve_app, wait_until

# -- settings ------------------------------------------------------------------------


def test_settings_reject_a_kind_without_its_section() -> None:
    with pytest.raises(ValidationError, match=r"discovery\.dns is not set"):
        DiscoverySettings(kind="dns")
    with pytest.raises(ValidationError, match=r"discovery\.k8s is not set"):
        DiscoverySettings(kind="k8s")


def test_settings_reject_unknown_fields_and_duplicate_static_names() -> None:
    with pytest.raises(ValidationError, match="hostnme"):
        DiscoverySettings.model_validate({"kind": "dns", "dns": {"hostnme": "x"}})
    pod = {"name": "a", "url": "http://127.0.0.1:1"}
    with pytest.raises(ValidationError, match="duplicate pod names"):
        DiscoverySettings.model_validate({"static": [pod, pod]})


# -- static --------------------------------------------------------------------------


async def test_static_discovery_registers_the_configured_pods() -> None:
    settings = DiscoverySettings.model_validate(
        {
            "static": [
                {
                    "name": "p0",
                    "url": "http://127.0.0.1:8001/",
                    "events_endpoint": "tcp://127.0.0.1:5557",
                    "replay_endpoint": "tcp://127.0.0.1:5657",
                    "models": ["m"],
                },
                {"name": "p1", "url": "http://127.0.0.1:8002"},
            ]
        }
    )
    disc = build_discovery(settings)
    assert isinstance(disc, StaticDiscovery)
    reg = PodRegistry()
    await disc.run(reg)
    p0 = reg.get("p0")
    assert p0 is not None
    assert p0.spec.url == "http://127.0.0.1:8001"  # trailing slash dropped
    assert p0.spec.events_endpoint == "tcp://127.0.0.1:5557"
    assert p0.spec.replay_endpoint == "tcp://127.0.0.1:5657"
    assert p0.models == {"m"}
    assert sorted(p.name for p in reg.all()) == ["p0", "p1"]


# -- DNS -----------------------------------------------------------------------------


async def test_dns_discovery_makes_one_pod_per_address_of_the_hostname() -> None:
    disc = DnsDiscovery(
        DnsDiscoverySettings(
            hostname="localhost", port=8123, events_port=5557, replay_port=5657, models=["m"]
        )
    )
    specs = {s.name: s for s in await disc.resolve()}
    assert "127.0.0.1:8123" in specs
    spec = specs["127.0.0.1:8123"]
    assert spec.url == "http://127.0.0.1:8123"
    assert spec.events_endpoint == "tcp://127.0.0.1:5557"
    assert spec.replay_endpoint == "tcp://127.0.0.1:5657"
    assert spec.models == ("m",)
    for s in specs.values():  # IPv6 addresses are bracketed in URLs and endpoints
        if ":" in s.name.rsplit(":", 1)[0]:
            assert s.url.startswith("http://[")


async def test_dns_discovery_re_resolves_and_fills_the_registry() -> None:
    disc = DnsDiscovery(DnsDiscoverySettings(hostname="localhost", port=8123, interval_s=0.01))
    reg = PodRegistry()
    async with running(disc.run(reg)):
        await wait_until(lambda: disc.resolutions >= 2)
        assert reg.get("127.0.0.1:8123") is not None


@pytest.mark.parametrize(
    "bad_name", ["kvroute-no-such-host.invalid", "x" * 70 + ".example"], ids=["nxdomain", "bad"]
)
async def test_dns_discovery_keeps_the_last_fleet_when_resolution_fails(bad_name: str) -> None:
    settings = DnsDiscoverySettings(hostname="localhost", port=8123, interval_s=0.01)
    disc = DnsDiscovery(settings)
    reg = PodRegistry()
    reg.set_pods(await disc.resolve())
    before = sorted(p.name for p in reg.all())
    settings.hostname = bad_name
    async with running(disc.run(reg)):
        await wait_until(lambda: disc.failures >= 1, timeout=30)
    assert sorted(p.name for p in reg.all()) == before


# -- Kubernetes ----------------------------------------------------------------------


def k8s_pod(
    name: str,
    ip: str | None = "10.0.0.1",
    ready: bool = True,
    annotations: dict[str, str] | None = None,
    rv: str = "1",
) -> dict[str, Any]:
    status: dict[str, Any] = {
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]
    }
    if ip:
        status["podIP"] = ip
    return {
        "metadata": {
            "name": name,
            "resourceVersion": rv,
            "annotations": annotations or {},
        },
        "status": status,
    }


class FakeApiServer:
    """The two Pod endpoints of a Kubernetes API server, scripted by the test."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.list_rv = "100"
        self.watch_queue: asyncio.Queue[dict[str, Any] | str | None] = asyncio.Queue()
        self.requests: list[dict[str, Any]] = []
        self.gone_on_next_watch = False
        app = FastAPI()

        @app.get("/api/v1/namespaces/{ns}/pods")
        async def pods(ns: str, request: Request) -> Any:
            q = dict(request.query_params)
            self.requests.append(
                {"ns": ns, "query": q, "auth": request.headers.get("authorization")}
            )
            if q.get("watch") not in ("1", "true"):
                return {
                    "kind": "PodList",
                    "metadata": {"resourceVersion": self.list_rv},
                    "items": self.items,
                }
            if self.gone_on_next_watch:
                self.gone_on_next_watch = False
                return JSONResponse({"kind": "Status", "code": 410}, status_code=410)

            async def lines() -> AsyncIterator[bytes]:
                while True:
                    ev = await self.watch_queue.get()
                    if ev is None:  # end this watch stream (server-side timeout)
                        return
                    line = ev if isinstance(ev, str) else json.dumps(ev)
                    yield (line + "\n").encode()

            return StreamingResponse(lines(), media_type="application/json")

        self.app = app

    def watches(self) -> list[dict[str, Any]]:
        return [r for r in self.requests if r["query"].get("watch")]

    def lists(self) -> list[dict[str, Any]]:
        return [r for r in self.requests if not r["query"].get("watch")]


def k8s_settings(url: str, tmp_path: Path, **kw: Any) -> K8sDiscoverySettings:
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    return K8sDiscoverySettings(
        namespace="llm",
        label_selector="app=vllm",
        api_server=url,
        token_file=str(token),
        events_port=5557,
        retry_s=0.05,
        **kw,
    )


@contextlib.asynccontextmanager
async def k8s_discovery_running(
    api: FakeApiServer, tmp_path: Path, **kw: Any
) -> AsyncIterator[tuple[K8sDiscovery, PodRegistry]]:
    """Serve ``api`` on loopback and run a K8sDiscovery (``kw``: its settings) against it
    for the block."""
    async with serve_app(api.app) as url:
        disc = K8sDiscovery(k8s_settings(url, tmp_path, **kw))
        reg = PodRegistry()
        async with running(disc.run(reg)):
            yield disc, reg


def test_only_ready_pods_with_an_ip_that_are_not_terminating_count() -> None:
    assert pod_is_ready(k8s_pod("a"))
    assert not pod_is_ready(k8s_pod("a", ready=False))
    assert not pod_is_ready(k8s_pod("a", ip=None))
    terminating = k8s_pod("a")
    terminating["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    assert not pod_is_ready(terminating)
    assert not pod_is_ready({"metadata": {"name": "a"}, "status": {"podIP": "10.0.0.1"}})


def test_ports_and_models_come_from_annotations_else_settings(tmp_path: Path) -> None:
    disc = K8sDiscovery(k8s_settings("http://127.0.0.1:1", tmp_path, models=["base"]))
    plain = disc.spec_of(k8s_pod("a", ip="10.0.0.1"))
    assert plain.url == "http://10.0.0.1:8000"
    assert plain.events_endpoint == "tcp://10.0.0.1:5557"
    assert plain.replay_endpoint is None
    assert plain.models == ("base",)
    annotated = disc.spec_of(
        k8s_pod(
            "b",
            ip="10.0.0.2",
            annotations={
                "kvroute.io/port": "9000",
                "kvroute.io/events-port": "6000",
                "kvroute.io/replay-port": "6001",
                "kvroute.io/models": "m1, m2",
            },
        )
    )
    assert annotated.url == "http://10.0.0.2:9000"
    assert annotated.events_endpoint == "tcp://10.0.0.2:6000"
    assert annotated.replay_endpoint == "tcp://10.0.0.2:6001"
    assert annotated.models == ("m1", "m2")
    with pytest.raises(ValueError, match=r"kvroute\.io/port='http' is not a port"):
        disc.spec_of(k8s_pod("c", annotations={"kvroute.io/port": "http"}))


def test_several_ports_make_one_endpoint_per_port_with_its_rank_s_event_ports(
    tmp_path: Path,
) -> None:
    disc = K8sDiscovery(
        k8s_settings("http://127.0.0.1:1", tmp_path, ports=[8000, 8001, 8002], replay_port=5657)
    )
    specs = disc.specs_of(k8s_pod("dp", ip="10.0.0.3"))
    assert [s.name for s in specs] == ["dp-rank-0", "dp-rank-1", "dp-rank-2"]
    assert [s.url for s in specs] == [
        "http://10.0.0.3:8000",
        "http://10.0.0.3:8001",
        "http://10.0.0.3:8002",
    ]
    assert [s.events_endpoint for s in specs] == [
        "tcp://10.0.0.3:5557",
        "tcp://10.0.0.3:5558",
        "tcp://10.0.0.3:5559",
    ]
    assert specs[2].replay_endpoint == "tcp://10.0.0.3:5659"
    # an annotated port is the pod's one endpoint, named as the pod
    (one,) = disc.specs_of(k8s_pod("b", ip="10.0.0.4", annotations={"kvroute.io/port": "9000"}))
    assert (one.name, one.url) == ("b", "http://10.0.0.4:9000")
    # one port in the list: the pod's own name, as with `port`
    single = K8sDiscovery(k8s_settings("http://127.0.0.1:1", tmp_path, ports=[8100]))
    assert [(s.name, s.url) for s in single.specs_of(k8s_pod("a", ip="10.0.0.1"))] == [
        ("a", "http://10.0.0.1:8100")
    ]


def test_a_ports_list_repeating_a_port_or_longer_than_a_pool_s_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="lists a port twice"):
        k8s_settings("http://127.0.0.1:1", tmp_path, ports=[8000, 8000])
    with pytest.raises(ValueError, match="at most 8"):
        k8s_settings("http://127.0.0.1:1", tmp_path, ports=list(range(8000, 8009)))
    disc = K8sDiscovery(k8s_settings("http://127.0.0.1:1", tmp_path, ports=[8000, 8001]))
    high = k8s_pod("h", annotations={"kvroute.io/events-port": "65535"})
    with pytest.raises(ValueError, match="events port of rank 1 would be 65536"):
        disc.specs_of(high)


ACTIVE = "inference.networking.k8s.io/active-ports"  # GIE's annotation


def test_a_pod_is_an_endpoint_only_on_the_target_ports_its_active_ports_annotation_lists(
    tmp_path: Path,
) -> None:
    # GIE's datastore (extractActivePorts): a rank keeps its index among the targetPorts
    disc = K8sDiscovery(k8s_settings("http://127.0.0.1:1", tmp_path, ports=[8000, 8001, 8002]))
    specs = disc.specs_of(k8s_pod("dp", ip="10.0.0.3", annotations={ACTIVE: "8000, 8002"}))
    assert [(s.name, s.url, s.events_endpoint) for s in specs] == [
        ("dp-rank-0", "http://10.0.0.3:8000", "tcp://10.0.0.3:5557"),
        ("dp-rank-2", "http://10.0.0.3:8002", "tcp://10.0.0.3:5559"),
    ]
    # entries that do not parse, or are not target ports, are ignored (as Go's Sscanf %d)
    odd = disc.specs_of(k8s_pod("o", annotations={ACTIVE: "http,9999,8001 ,-8000,0"}))
    assert [s.name for s in odd] == ["o-rank-1"]
    # none active: the pod has no endpoint (skipped, saying why)
    for value in ("", "9000", "http"):
        with pytest.raises(ValueError, match=r"no port of \[8000, 8001, 8002\] is active"):
            disc.specs_of(k8s_pod("n", annotations={ACTIVE: value}))
    # one target port: active or not, named as the pod
    single = K8sDiscovery(k8s_settings("http://127.0.0.1:1", tmp_path))
    assert single.spec_of(k8s_pod("a", annotations={ACTIVE: "8000"})).name == "a"
    with pytest.raises(ValueError, match=r"no port of \[8000\] is active"):
        single.specs_of(k8s_pod("a", annotations={ACTIVE: "8001"}))


async def test_k8s_discovery_follows_a_pod_s_active_ports_as_they_change(tmp_path: Path) -> None:
    api = FakeApiServer()
    api.items = [
        k8s_pod("a", ip="10.0.0.1"),
        k8s_pod("b", ip="10.0.0.2", annotations={ACTIVE: "8001"}),
        k8s_pod("c", ip="10.0.0.3", annotations={ACTIVE: "9000"}),
    ]
    async with k8s_discovery_running(api, tmp_path, ports=[8000, 8001]) as (disc, reg):
        await wait_until(lambda: len(api.watches()) == 1)
        listed = sorted(p.name for p in reg.all())
        skipped = sorted(disc.skipped)
        # a drains rank 1, c's annotation goes away: all its target ports count
        drained = k8s_pod("a", ip="10.0.0.1", annotations={ACTIVE: "8000"}, rv="101")
        await api.watch_queue.put({"type": "MODIFIED", "object": drained})
        await api.watch_queue.put({"type": "MODIFIED", "object": k8s_pod("c", "10.0.0.3")})
        await wait_until(lambda: reg.get("c-rank-1") is not None)
        after = sorted(p.name for p in reg.all())
    assert listed == ["a-rank-0", "a-rank-1", "b-rank-1"]
    assert skipped == ["c"]
    assert after == ["a-rank-0", "b-rank-1", "c-rank-0", "c-rank-1"]


async def test_k8s_discovery_registers_every_rank_of_a_multi_port_pod(tmp_path: Path) -> None:
    api = FakeApiServer()
    api.items = [k8s_pod("a", ip="10.0.0.1"), k8s_pod("b", ip="10.0.0.2")]
    async with k8s_discovery_running(api, tmp_path, ports=[8000, 8001]) as (_disc, reg):
        await wait_until(lambda: len(reg.all()) == 4)
        names = sorted(p.name for p in reg.all())
        await api.watch_queue.put({"type": "DELETED", "object": k8s_pod("a", "10.0.0.1", rv="102")})
        await wait_until(lambda: len(reg.all()) == 2)
        left = sorted(p.name for p in reg.all())
    assert names == ["a-rank-0", "a-rank-1", "b-rank-0", "b-rank-1"]
    assert left == ["b-rank-0", "b-rank-1"]


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
