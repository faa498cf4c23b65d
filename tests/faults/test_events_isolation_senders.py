"""Isolated KV-event ingestion (issue #10), who may speak for a pod: bind mode on loopback,
the ZAP handshake of a bound SUB admitting only discovered pods, topics naming another pod.

Addresses 127.0.0.2-127.0.0.4 are loopback too (Linux routes 127/8 locally): a publisher
connects *from* one of them with ZMQ's ``tcp://source;destination`` form, so the
subscriber sees it as another host.
"""

from __future__ import annotations

import zmq
import zmq.asyncio
from prometheus_client import generate_latest

from router.events import EventsSettings, make_topic
from router.fleet.pods import PodSpec
from tests.faults.events_isolation_support import ctx as ctx  # the fixture
from tests.support.aio import wait_until
from tests.support.kv_events import (
    MODEL,
    Harness,
    VllmLikePublisher,
    chain,
    dial_pod,
    payload,
    stored,
)


def test_bind_mode_listens_on_loopback_and_admits_discovered_pods_by_default() -> None:
    s = EventsSettings()
    assert s.bind_endpoint == "tcp://127.0.0.1:5557"
    assert s.bind_allow == "discovered"


def from_host(ip: str, endpoint: str) -> str:
    """``endpoint`` dialled from source address ``ip`` (ZMQ: tcp://src:0;dst)."""
    return f"tcp://{ip}:0;{endpoint.removeprefix('tcp://')}"


async def test_zap_admits_only_the_addresses_of_discovered_pods(
    ctx: zmq.asyncio.Context,
) -> None:
    h = Harness(ctx, EventsSettings(mode="bind", bind_endpoint="tcp://127.0.0.1:*"))
    await h.sub.start()
    ep = h.sub.bound_endpoint
    assert ep is not None
    h.registry.set_pods(
        [
            PodSpec(name="a", url="http://127.0.0.2:8000"),
            PodSpec(name="b", url="http://127.0.0.4:8000"),
        ]
    )
    a = VllmLikePublisher(ctx, make_topic("a", MODEL), connect_to=from_host("127.0.0.2", ep))
    stranger = VllmLikePublisher(
        ctx, make_topic("a", MODEL), connect_to=from_host("127.0.0.3", ep), replay=False
    )
    b = VllmLikePublisher(
        ctx, make_topic("a", MODEL), connect_to=from_host("127.0.0.4", ep), replay=False
    )
    try:
        await a.subscribed()
        await a.send([stored(chain(1), [1])])
        await h.applied(1, "a")
        await wait_until(lambda: h.sub.stats.zap_held >= 1)  # the stranger waits outside
        await b.subscribed()
        await b.send([stored(chain(3, start=800), [7, 8, 9])], seq=1)  # b speaking for a
        await wait_until(lambda: h.sub.stats.pod("a").rejected["wrong_source"] == 1)
        assert h.sub.stats.zap_admitted == 2
        assert await h.blocks_held(chain(3, start=800), "a") == 0
        assert h.sub.stats.pod("a").batches == 1
        # discovery names the stranger's address: its held connection is let in
        h.registry.set_pods(
            [
                PodSpec(name="a", url="http://127.0.0.2:8000"),
                PodSpec(name="b", url="http://127.0.0.4:8000"),
                PodSpec(name="c", url="http://127.0.0.3:8000"),
            ]
        )
        await stranger.subscribed()
        await stranger.send([stored(chain(1), [1])])  # still not a's address
        await wait_until(lambda: h.sub.stats.pod("a").rejected["wrong_source"] == 2)
        stranger.topic = make_topic("c", MODEL).encode()
        await stranger.send([stored(chain(2), [1, 2])], seq=0)
        await h.applied(1, "c")
        assert await h.blocks_held(chain(2), "c") == 2
        text = generate_latest(h.metrics).decode()
        assert 'kvroute_event_rejected_total{pod="a",reason="wrong_source"} 2.0' in text
    finally:
        await h.sub.stop()
        for p in (a, stranger, b):
            await p.close()


async def test_with_bind_allow_any_a_publisher_from_anywhere_is_read(
    ctx: zmq.asyncio.Context,
) -> None:
    h = Harness(
        ctx, EventsSettings(mode="bind", bind_endpoint="tcp://127.0.0.1:*", bind_allow="any")
    )
    await h.sub.start()
    assert h.sub.bound_endpoint is not None
    h.registry.set_pods([PodSpec(name="a", url="http://10.9.9.9:8000")])
    a = VllmLikePublisher(
        ctx, make_topic("a", MODEL), connect_to=from_host("127.0.0.3", h.sub.bound_endpoint)
    )
    try:
        await a.subscribed()
        await a.send([stored(chain(1), [1])])
        await h.applied(1, "a")
        assert h.sub.stats.zap_held == 0
    finally:
        await h.sub.stop()
        await a.close()


async def test_in_dial_mode_a_topic_naming_another_pod_is_rejected(
    ctx: zmq.asyncio.Context,
) -> None:
    async with dial_pod(ctx) as (h, pub):
        other = make_topic("someone-else", MODEL).encode()
        await pub.send_raw([other, (0).to_bytes(8, "big"), payload([stored(chain(2), [1, 2])])])
        await wait_until(lambda: h.sub.stats.pod("p").rejected["wrong_pod"] == 1)
        pub.topic = b"kv-events"  # not the kv@ convention (vLLM's own topics): fine
        await pub.send([stored(chain(1, start=400), [5])])
        await h.applied(1)
        assert await h.blocks_held(chain(2)) == 0
        assert await h.blocks_held(chain(1, start=400)) == 1
