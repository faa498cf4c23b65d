"""Kubernetes discovery: which pods count (ready, an IP, not terminating), their ports and
models from annotations, multi-port pods' ranks, and GIE's active-ports annotation.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from router.fleet.k8s import K8sDiscovery
from router.fleet.k8s_endpoints import pod_is_ready
from tests.router.discovery_support import (
    FakeApiServer,
    k8s_discovery_running,
    k8s_pod,
    k8s_settings,
)
from tests.support.aio import wait_until


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
