"""Isolated KV-event ingestion (issue #10), per-pod bounds: a pod that overflows its queue
or floods garbage costs only itself (real ZMQ sockets on loopback, vLLM-like publishers
of :mod:`tests.support.kv_events`).
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import zmq
import zmq.asyncio
from prometheus_client import generate_latest

from router.events import EventsSettings, make_topic
from router.fleet.pods import PodSpec
from tests.faults.events_isolation_support import ctx as ctx  # the fixture
from tests.support.aio import wait_until
from tests.support.kv_events import (
    BS,
    MODEL,
    Harness,
    StalledIndex,
    VllmLikePublisher,
    chain,
    dial_pods,
    stored,
)

#: how long the flood test waits for its 20,000 messages to be handled
FLOOD_S = 120.0


async def test_a_pod_that_overflows_its_queue_drops_only_its_own_batches(
    ctx: zmq.asyncio.Context,
) -> None:
    async with dial_pods(ctx, ["a", "b"], queue_size=20) as (h, pubs):
        stalled = StalledIndex(h.index)
        h.sink.index = stalled
        await pubs["a"].send([stored(chain(1), [1])])  # a's seq 0 stalls the writer
        await asyncio.wait_for(stalled.entered.wait(), 10)
        for i in range(1, 200):  # a floods: 20 wait, the rest are dropped
            await pubs["a"].send([stored(chain(1, start=BS * i), [100 + i])])
        for i in range(3):  # b's batches wait in b's own queue
            await pubs["b"].send([stored(chain(1, start=10_000 + BS * i), [500 + i])])
        await wait_until(lambda: h.sub.stats.pod("a").dropped >= 150)
        await wait_until(lambda: h.sub.stats.queue_depth() == 20 + 3)
        stalled.gate.set()
        await h.applied(3, "b")
        b = h.sub.stats.pod("b")
        assert (b.dropped, b.total_resyncs, b.gaps) == (0, 0, 0)
        for i in range(3):
            assert await h.blocks_held(chain(1, start=10_000 + BS * i), "b") == 1
        await pubs["a"].send([stored(chain(1, start=90_000), [9])])  # after the drops
        await h.applied(22, "a")
        assert h.sub.stats.pod("a").resyncs["overflow"] == 1
        assert await h.blocks_held(chain(1, start=90_000), "a") == 1


async def test_a_flood_of_garbage_quarantines_its_pod_and_leaves_the_others_alone(
    ctx: zmq.asyncio.Context, caplog: pytest.LogCaptureFixture
) -> None:
    """The fault run's flood, in bind mode (one shared socket): 20,000 messages of which
    most do not decode.  The healthy pod keeps every batch and is never cleared; the
    flooding pod costs `fault_budget` resyncs, then is quarantined; the log gets a
    handful of lines, not 20,000."""
    h = Harness(
        ctx,
        EventsSettings(
            mode="bind", bind_endpoint="tcp://127.0.0.1:*", fault_budget=5, fault_window_s=60
        ),
    )
    await h.sub.start()
    assert h.sub.bound_endpoint is not None
    h.registry.set_pods([PodSpec(name=n, url="http://127.0.0.1:1") for n in ("bad", "ok")])
    bad = VllmLikePublisher(ctx, make_topic("bad", MODEL), connect_to=h.sub.bound_endpoint)
    ok = VllmLikePublisher(ctx, make_topic("ok", MODEL), connect_to=h.sub.bound_endpoint)
    try:
        await bad.subscribed()
        await ok.subscribed()
        topic = make_topic("bad", MODEL).encode()
        with caplog.at_level(logging.INFO, logger="router.events"):
            for i in range(20_000):
                if i % 2:
                    seq = i // 2
                    await bad.send_raw([topic, seq.to_bytes(8, "big"), b"\xc1 not msgpack"])
                else:
                    await bad.send_raw([topic, b"\x00" * 7, b"x"])  # malformed framing
                if i % 4000 == 0:
                    await ok.send([stored(chain(1, start=BS * i), [1 + i])])
            await ok.send([stored(chain(1, start=10**6), [10**6])])
            # 20,000 messages: on a loaded machine they take longer than the usual 20 s
            await h.applied(6, "ok", timeout=FLOOD_S)
            flood = h.sub.stats.pod("bad")
            await wait_until(lambda: flood.malformed_frames == 10_000, timeout=FLOOD_S)
            await wait_until(
                lambda: flood.decode_errors + flood.rejected["quarantined"] == 10_000,
                timeout=FLOOD_S,
            )
            await h.sub.drain()
        good = h.sub.stats.pod("ok")
        assert (good.total_resyncs, good.dropped, good.decode_errors) == (0, 0, 0)
        for i in range(0, 20_000, 4000):
            assert await h.blocks_held(chain(1, start=BS * i), "ok") == 1
        assert flood.decode_errors == 6  # fault_budget + the one that tripped it
        assert flood.quarantines == 1
        assert flood.rejected["quarantined"] == 10_000 - 6
        lines = [r for r in caplog.records if "bad" in r.getMessage()]
        assert 0 < len(lines) <= 10, [r.getMessage() for r in lines]
        text = generate_latest(h.metrics).decode()
        assert 'kvroute_event_quarantines_total{pod="bad"} 1.0' in text
        assert 'kvroute_event_rejected_total{pod="bad",reason="quarantined"} 9994.0' in text
    finally:
        await h.sub.stop()
        await bad.close()
        await ok.close()
