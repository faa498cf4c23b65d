"""The KV-event subscriber in bind mode (pods connect to us, named by their topics) and
its replay client (a pod's replay buffer, join replay of a late joiner), over real ZMQ
sockets on loopback with a test publisher in vLLM's wire format
(:mod:`tests.support.kv_events`).
"""

from __future__ import annotations

import pytest
import zmq
import zmq.asyncio
from prometheus_client import generate_latest

from router.events import (
    EventsSettings,
    ReplayError,
    fetch_replay,
    make_topic,
)
from router.fleet.pods import PodSpec
from tests.support.aio import wait_until
from tests.support.kv_events import (
    BS,
    MODEL,
    Harness,
    VllmLikePublisher,
    chain,
    dial_pod,
    pod_of,
    removed,
    stored,
)
from tests.support.kv_events import ctx as ctx  # the fixture

# -- bind mode -------------------------------------------------------------------------


async def test_bind_mode_names_pods_by_topic_and_counts_strangers(
    ctx: zmq.asyncio.Context,
) -> None:
    h = Harness(ctx, EventsSettings(mode="bind", bind_endpoint="tcp://127.0.0.1:*"))
    await h.sub.start()
    assert h.sub.bound_endpoint is not None
    h.registry.set_pods([PodSpec(name=n, url="http://127.0.0.1:1") for n in ("a", "b")])
    pubs = {
        name: VllmLikePublisher(
            ctx, make_topic(name, MODEL), connect_to=h.sub.bound_endpoint, replay=False
        )
        for name in ("a", "b", "stranger")
    }
    bad = VllmLikePublisher(ctx, "not-a-kv-topic", connect_to=h.sub.bound_endpoint, replay=False)
    try:
        for p in [*pubs.values(), bad]:
            await p.subscribed()
        await pubs["a"].send([stored(chain(1), [1])])
        await pubs["b"].send([stored(chain(2), [7, 8])])
        await pubs["stranger"].send([stored(chain(3), [4, 5, 6])])
        await bad.send([stored(chain(3), [4, 5, 6])])
        await h.applied(1, "a")
        await h.applied(1, "b")
        await wait_until(lambda: h.sub.stats.unknown_pod_batches == 1)
        await wait_until(lambda: h.sub.stats.bad_topics == 1)
        assert await h.blocks_held(chain(2), "a") == 1
        assert await h.blocks_held(chain(2), "b") == 2
        assert await h.blocks_held(chain(3), "stranger") == 0
        # seq is tracked per pod: b's seq 1 is no gap even though a is at seq 1 too
        await pubs["b"].send([removed([8])])
        await h.applied(2, "b")
        assert h.sub.stats.pod("b").gaps == 0
        assert await h.blocks_held(chain(2), "b") == 1
    finally:
        await h.sub.stop()
        for p in [*pubs.values(), bad]:
            await p.close()


# -- replay client ---------------------------------------------------------------------


async def test_fetch_replay_reads_buffered_batches_until_the_end_marker(
    ctx: zmq.asyncio.Context,
) -> None:
    pub = VllmLikePublisher(ctx)
    try:
        for _ in range(5):
            await pub.send([], publish=False)
        assert pub.replay_endpoint is not None
        got = await fetch_replay(ctx, pub.replay_endpoint, 2)
        assert [b.seq for b in got] == [2, 3, 4]
        assert got[0].payload == pub.buffer[2][1]
        got = await fetch_replay(ctx, pub.replay_endpoint, 1, stop_seq=3)
        assert [b.seq for b in got] == [1, 2]
        assert await fetch_replay(ctx, pub.replay_endpoint, 9) == []
    finally:
        await pub.close()


async def test_fetch_replay_times_out_on_a_silent_endpoint(ctx: zmq.asyncio.Context) -> None:
    silent = ctx.socket(zmq.ROUTER)
    silent.bind("tcp://127.0.0.1:*")
    try:
        with pytest.raises(ReplayError, match="sent nothing"):
            await fetch_replay(ctx, silent.getsockopt_string(zmq.LAST_ENDPOINT), 0, timeout_s=0.2)
    finally:
        silent.close(linger=0)


async def test_a_late_joiner_first_applies_the_pods_replay_buffer(
    ctx: zmq.asyncio.Context,
) -> None:
    h = Harness(ctx, EventsSettings(mode="dial"))
    pub = VllmLikePublisher(ctx, make_topic("p", MODEL))
    try:
        tokens = chain(3)
        # the engine ran before we subscribed: seq 0-1 went to nobody
        await pub.send([stored(tokens[:BS], [1])], publish=False)
        await pub.send([stored(tokens[BS : 2 * BS], [2], parent=1)], publish=False)
        await h.sub.start()
        h.registry.set_pods([pod_of(pub)])
        await pub.subscribed()
        await pub.send([stored(tokens[2 * BS :], [3], parent=2)])  # seq 2: first seen
        await h.applied(3)
        assert pub.replay_requests == [0]
        assert await h.blocks_held(tokens) == 3
        st = h.sub.stats.pod("p")
        assert (st.replays, st.replayed_batches, st.gaps) == (1, 2, 0)
        assert h.sink.applier.stats.orphaned_blocks == 0
    finally:
        await h.sub.stop()
        await pub.close()


async def test_without_join_replay_a_late_joiners_chain_is_counted_as_orphans(
    ctx: zmq.asyncio.Context,
) -> None:
    async with dial_pod(ctx, replay_on_join=False) as (h, pub):
        tokens = chain(2)
        await pub.send([stored(tokens[BS:], [2], parent=1)], seq=7)  # parent never seen
        await h.applied(1)
        assert pub.replay_requests == []
        assert h.sink.applier.stats.orphaned_blocks == 1
        assert await h.blocks_held(tokens) == 0
        text = generate_latest(h.metrics).decode()
        assert "kvroute_event_applier_orphaned_blocks_total 1.0" in text


async def test_a_batch_with_a_bad_event_resyncs_the_pod(ctx: zmq.asyncio.Context) -> None:
    async with dial_pod(ctx) as (h, pub):
        await pub.send([stored(chain(2), [1, 2])])
        await h.applied(1)
        bad = stored(chain(1, start=500), [5])
        bad["token_ids"] = [1, 2, 3]  # not block_size tokens per hash
        await pub.send([bad, stored(chain(1, start=900), [9])])
        await h.applied(2)
        st = h.sub.stats.pod("p")
        assert st.resyncs["lost_events"] == 1
        assert h.sink.applier.stats.bad_events == 1
        assert await h.blocks_held(chain(2)) == 0
        assert not h.sink.lost_events("p")  # the resync reset the flag


async def test_the_plain_scoring_sink_works_without_the_router_extensions(
    ctx: zmq.asyncio.Context,
) -> None:
    from scoring.events import IndexSink as ScoringIndexSink

    h = Harness(ctx, EventsSettings(mode="dial"))
    h.sink = ScoringIndexSink(h.index)  # type: ignore[assignment]  # no remove_pod / lost_events
    h.sub.sink = h.sink
    pub = VllmLikePublisher(ctx, make_topic("p", MODEL))
    await h.sub.start()
    try:
        h.registry.set_pods(
            [PodSpec(name="p", url="http://127.0.0.1:1", events_endpoint=pub.endpoint)]
        )
        await pub.subscribed()
        await pub.send([stored(chain(2), [1, 2])])
        await h.applied(1)
        assert await h.blocks_held(chain(2)) == 2
        assert (
            "kvroute_event_applier_stored_blocks_total 2.0" in generate_latest(h.metrics).decode()
        )
        h.registry.set_pods([])
        assert await h.blocks_held(chain(2)) == 0
    finally:
        await h.sub.stop()
        await pub.close()
