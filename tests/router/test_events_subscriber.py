"""The KV-event subscriber in dial mode, over real ZMQ sockets on loopback: its
settings and topics, blocks applied to the index, seq gaps filled by replay or resynced,
engine restarts, bad messages and batches, queue overflow and backlogs, its metrics.

A test publisher speaks vLLM's wire format (``vllm/distributed/kv_events.py``, see
:mod:`tests.support.kv_events`).  Batches go into a real :class:`InMemoryIndex` through
:class:`IndexSink` (``scoring.events``' decoder and applier); the tests look blocks up
with the router's own key chain.  Bind mode and the replay client:
``test_events_bind_and_replay``; real and simulated engines: ``test_events_engines``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import zmq
import zmq.asyncio
from prometheus_client import generate_latest
from pydantic import ValidationError

from router.events import (
    EventsSettings,
    TopicError,
    make_topic,
    parse_topic,
)
from tests.support.aio import wait_until
from tests.support.kv_events import (
    BS,
    MODEL,
    StalledIndex,
    VllmLikePublisher,
    chain,
    dial_pod,
    payload,
    removed,
    stored,
)
from tests.support.kv_events import ctx as ctx  # the fixture

# -- settings and topics ---------------------------------------------------------------


def test_settings_reject_unknown_fields_and_bad_modes() -> None:
    with pytest.raises(ValidationError, match="queue_sise"):
        EventsSettings.model_validate({"queue_sise": 3})
    with pytest.raises(ValidationError, match="mode"):
        EventsSettings.model_validate({"mode": "listen"})


def test_topic_names_pod_and_model() -> None:
    assert parse_topic(b"kv@pod-1@Qwen/Qwen3-8B") == ("pod-1", "Qwen/Qwen3-8B")
    assert parse_topic(b"kv@pod-1@org/model@rev") == ("pod-1", "org/model@rev")
    assert parse_topic(make_topic("a", "b").encode()) == ("a", "b")
    for bad in (b"", b"kv", b"kv@", b"xx@p@m", b"\xff\xfe"):
        with pytest.raises(TopicError):
            parse_topic(bad)
    with pytest.raises(TopicError, match="must not contain '@'"):
        make_topic("a@b", "m")


# -- dial mode -------------------------------------------------------------------------


async def test_dial_mode_applies_stored_and_removed_blocks_to_the_index(
    ctx: zmq.asyncio.Context,
) -> None:
    async with dial_pod(ctx) as (h, pub):
        tokens = chain(3)
        await pub.send([stored(tokens, [101, 102, 103])])
        await h.applied(1)
        assert await h.blocks_held(tokens) == 3
        await pub.send([removed([103])])
        await h.applied(2)
        assert await h.blocks_held(tokens) == 2
        st = h.sub.stats.pod("p")
        assert (st.batches, st.events, st.gaps, st.last_seq) == (2, 2, 0, 1)
        assert st.lag_s >= 0.0


async def test_a_seq_gap_is_filled_from_the_pods_replay_endpoint(
    ctx: zmq.asyncio.Context,
) -> None:
    async with dial_pod(ctx) as (h, pub):
        a, b, c = chain(1), chain(2), chain(3)
        await pub.send([stored(a, [1])])  # seq 0
        await pub.send([stored(b[BS:], [2], parent=1)], publish=False)  # seq 1 lost
        await pub.send([stored(c[2 * BS :], [3], parent=2)])  # seq 2
        await h.applied(3)
        assert await h.blocks_held(c) == 3  # the lost batch came back by replay
        st = h.sub.stats.pod("p")
        assert (st.gaps, st.missed_batches, st.replays, st.replayed_batches) == (1, 1, 1, 1)
        assert pub.replay_requests == [1]
        assert st.total_resyncs == 0


async def test_a_gap_without_a_replay_endpoint_resyncs_the_pod(
    ctx: zmq.asyncio.Context,
) -> None:
    async with dial_pod(ctx, replay=False) as (h, pub):
        await pub.send([stored(chain(2), [1, 2])])
        await pub.send([stored(chain(1, start=1000), [9])], publish=False)
        await pub.send([stored(chain(1, start=500), [5])])
        await h.applied(2)
        # the pod was cleared at the gap: what came before is forgotten
        assert await h.blocks_held(chain(2)) == 0
        assert await h.blocks_held(chain(1, start=500)) == 1
        st = h.sub.stats.pod("p")
        assert st.gaps == 1
        assert st.resyncs["gap"] == 1
        assert st.replays == 0


async def test_replay_disabled_by_setting_resyncs_instead(ctx: zmq.asyncio.Context) -> None:
    async with dial_pod(ctx, replay_on_gap=False) as (h, pub):
        await pub.send([stored(chain(2), [1, 2])])
        await pub.send([], publish=False)
        await pub.send([stored(chain(1, start=500), [5])])
        await h.applied(2)
        assert pub.replay_requests == []
        assert h.sub.stats.pod("p").resyncs["gap"] == 1
        assert await h.blocks_held(chain(2)) == 0


async def test_a_gap_older_than_the_replay_buffer_resyncs_and_relearns_what_it_holds(
    ctx: zmq.asyncio.Context,
) -> None:
    async with dial_pod(ctx) as (h, pub):
        await pub.send([stored(chain(2), [1, 2])])  # seq 0
        await pub.send([], publish=False)  # seq 1 lost...
        await pub.send([stored(chain(1, start=300), [3])], publish=False)  # seq 2 lost
        await pub.send([stored(chain(1, start=500), [5])])  # seq 3
        pub.buffer = [e for e in pub.buffer if e[0] != 1]  # ...and seq 1 aged out
        await h.applied(3)
        st = h.sub.stats.pod("p")
        assert (st.gaps, st.replays, st.replay_failures) == (1, 0, 1)
        assert st.resyncs["gap"] == 1
        assert st.replayed_batches == 1  # seq 2, still in the buffer
        assert await h.blocks_held(chain(2)) == 0  # stored before the resync: forgotten
        assert await h.blocks_held(chain(1, start=300)) == 1  # re-learned from the buffer
        assert await h.blocks_held(chain(1, start=500)) == 1


async def test_a_lower_seq_means_the_engine_restarted_and_clears_the_pod(
    ctx: zmq.asyncio.Context,
) -> None:
    async with dial_pod(ctx) as (h, pub):
        for i in range(3):
            await pub.send([stored(chain(1, start=100 * i), [i])])
        await h.applied(3)
        assert await h.blocks_held(chain(1, start=200)) == 1
        await pub.send([stored(chain(1, start=900), [9])], seq=0)  # a new engine process
        await h.applied(4)
        st = h.sub.stats.pod("p")
        assert st.restarts == 1
        assert st.resyncs["restart"] == 1
        assert await h.blocks_held(chain(1, start=200)) == 0
        assert await h.blocks_held(chain(1, start=900)) == 1
        assert st.gaps == 0


async def test_a_restart_hidden_behind_a_reconnect_is_resynced_from_the_new_engine(
    ctx: zmq.asyncio.Context,
) -> None:
    async with dial_pod(ctx) as (h, old):
        for i in range(5):
            await old.send([stored(chain(1, start=100 * i), [i])])
        await h.applied(5)
        assert old.endpoint and old.replay_endpoint
        endpoint, replay_endpoint = old.endpoint, old.replay_endpoint
        await old.close()  # the engine dies; a new one binds the same ports...
        for _ in range(200):  # ...once ZMQ's I/O thread has released them
            try:
                new = VllmLikePublisher(
                    ctx, make_topic("p", MODEL), bind_to=endpoint, replay_bind_to=replay_endpoint
                )
                break
            except zmq.ZMQError:
                await asyncio.sleep(0.05)
        try:
            await new.subscribed()  # our SUB reconnected by itself
            # the new engine's first batches are lost before we see seq 6 (> 5 = expected:
            # by seq alone a gap, not a restart)
            for i in range(6):
                await new.send([stored(chain(1, start=1000 + 100 * i), [50 + i])], publish=False)
            await new.send([stored(chain(1, start=9000), [99])])
            await wait_until(lambda: h.sub.stats.pod("p").last_seq == 6)
            await h.sub.drain()
            st = h.sub.stats.pod("p")
            assert st.resyncs["reconnect"] == 1
            assert st.gaps == 0
            assert await h.blocks_held(chain(1, start=100)) == 0  # the dead engine's
            assert await h.blocks_held(chain(1, start=1200)) == 1  # by join replay
            assert await h.blocks_held(chain(1, start=9000)) == 1
            assert new.replay_requests == [0]
        finally:
            await new.close()


async def test_malformed_messages_are_counted_and_skipped(ctx: zmq.asyncio.Context) -> None:
    async with dial_pod(ctx) as (h, pub):
        topic = make_topic("p", MODEL).encode()
        await pub.send_raw([topic, b"\x00" * 8])  # two frames
        await pub.send_raw([topic, b"\x00" * 7, payload([])])  # 7-byte seq
        await pub.send_raw([topic, b"\x00" * 8, payload([]), b"extra"])  # four frames
        await pub.send([stored(chain(1), [1])])
        await h.applied(1)
        st = h.sub.stats.pod("p")
        assert st.malformed_frames == 3
        assert await h.blocks_held(chain(1)) == 1


async def test_a_garbage_payload_is_counted_and_resyncs_the_pod(ctx: zmq.asyncio.Context) -> None:
    async with dial_pod(ctx) as (h, pub):
        await pub.send([stored(chain(1), [1])])  # seq 0
        await h.applied(1)
        await pub.send_raw(
            [make_topic("p", MODEL).encode(), (1).to_bytes(8, "big"), b"\xc1not msgpack"]
        )
        pub.seq = 2
        await pub.send([stored(chain(1, start=500), [5])])  # seq 2
        await h.applied(2)
        st = h.sub.stats.pod("p")
        assert st.decode_errors == 1
        assert st.resyncs["decode_error"] == 1
        assert st.gaps == 0  # the garbage batch consumed seq 1
        assert await h.blocks_held(chain(1)) == 0
        assert await h.blocks_held(chain(1, start=500)) == 1


async def test_a_removed_pod_is_cleared_and_unsubscribed(ctx: zmq.asyncio.Context) -> None:
    async with dial_pod(ctx) as (h, pub):
        await pub.send([stored(chain(2), [1, 2])])
        await h.applied(1)
        h.registry.set_pods([])
        await h.sub.drain()
        assert await h.blocks_held(chain(2)) == 0
        assert h.sub.stats.pod("p").resyncs["removed"] == 1
        assert "p" not in h.sub._feeds


async def test_queue_overflow_drops_batches_and_resyncs_the_pod(
    ctx: zmq.asyncio.Context,
) -> None:
    async with dial_pod(ctx, queue_size=2) as (h, pub):
        stalled = StalledIndex(h.index)
        h.sink.index = stalled
        await pub.send([stored(chain(1), [0])])  # seq 0 stalls the writer
        await asyncio.wait_for(stalled.entered.wait(), 10)
        for i in range(1, 6):  # 1-2 fill the queue, 3-5 are dropped
            await pub.send([stored(chain(1, start=100 * i), [i])])
        await wait_until(lambda: h.sub.stats.pod("p").dropped == 3)
        assert h.sub.stats.queue_depth() == 2
        stalled.gate.set()
        await h.applied(3)
        assert h.sub.stats.pod("p").resyncs["overflow"] == 0  # not yet: no later batch
        await pub.send([stored(chain(1, start=900), [9])])  # seq 6
        await h.applied(4)
        st = h.sub.stats.pod("p")
        assert st.resyncs["overflow"] == 1
        assert st.gaps == 0  # the overflow resync, not a gap, accounts for 3..5
        assert await h.blocks_held(chain(1)) == 0
        assert await h.blocks_held(chain(1, start=900)) == 1


async def test_a_backlog_is_applied_in_grouped_index_writes_with_every_batch_counted(
    ctx: zmq.asyncio.Context,
) -> None:
    async with dial_pod(ctx) as (h, pub):
        stalled = StalledIndex(h.index)
        h.sink.index = stalled
        writes = 0
        real_write = h.sink.write

        async def counted(ops: Any) -> None:
            nonlocal writes
            writes += 1
            await real_write(ops)

        h.sink.write = counted  # type: ignore[method-assign]
        await pub.send([stored(chain(1), [0])])  # seq 0 stalls the writer
        await asyncio.wait_for(stalled.entered.wait(), 10)
        for i in range(1, 41):  # a backlog of 40 consecutive batches
            await pub.send([stored(chain(1, start=100 * i), [i])])
        await wait_until(lambda: h.sub.stats.queue_depth() == 40)
        stalled.gate.set()
        await h.applied(41)
        assert 0 < writes < 41  # grouped: fewer index writes than batches
        assert h.sub.stats.pod("p").batches == 41
        assert h.sub.stats.pod("p").last_seq == 40
        assert sum(h.sub.stats.pod("p").resyncs.values()) == 0
        for i in (1, 20, 40):
            assert await h.blocks_held(chain(1, start=100 * i)) == 1


async def test_a_bad_batch_inside_a_backlog_resyncs_after_the_good_ones_before_it(
    ctx: zmq.asyncio.Context,
) -> None:
    async with dial_pod(ctx) as (h, pub):
        stalled = StalledIndex(h.index)
        h.sink.index = stalled
        await pub.send([stored(chain(1), [0])])
        await asyncio.wait_for(stalled.entered.wait(), 10)
        await pub.send([stored(chain(1, start=100), [1])])  # seq 1
        await pub.send_raw([b"", (2).to_bytes(8, "big"), b"not msgpack"])  # seq 2
        await pub.send([stored(chain(1, start=300), [3])])  # seq 3
        await wait_until(lambda: h.sub.stats.queue_depth() == 3)
        stalled.gate.set()
        await h.applied(3)
        st = h.sub.stats.pod("p")
        assert st.decode_errors == 1
        assert st.resyncs["decode_error"] == 1
        assert await h.blocks_held(chain(1, start=100)) == 0  # cleared by the resync
        assert await h.blocks_held(chain(1, start=300)) == 1  # re-learned after it


async def test_stats_are_exposed_as_kvroute_metrics(ctx: zmq.asyncio.Context) -> None:
    async with dial_pod(ctx) as (h, pub):
        await pub.send([stored(chain(1), [1]), stored(chain(2)[BS:], [2], parent=1)])
        await h.applied(1)
        text = generate_latest(h.metrics).decode()
        assert 'kvroute_event_batches_total{pod="p"} 1.0' in text
        assert 'kvroute_events_ingested_total{pod="p"} 2.0' in text
        assert 'kvroute_event_gaps_total{pod="p"} 0.0' in text
        assert "kvroute_event_queue_depth 0.0" in text
        assert 'kvroute_event_lag_seconds{pod="p"}' in text
