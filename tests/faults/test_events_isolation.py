"""Isolated KV-event ingestion (issue #10): one pod's faults never cost another pod.

Real ZMQ sockets on loopback throughout: vLLM-like publishers
(:mod:`tests.support.kv_events`), a replay ROUTER served from a thread in a tight loop
of non-blocking sends exactly as vLLM's publisher thread does, simulated pods
(``router.sim``) with their real ``/metrics``, and the ZAP handshake of a bound SUB.
Addresses 127.0.0.2-127.0.0.4 are loopback too (Linux routes 127/8 locally): a
publisher connects *from* one of them with ZMQ's ``tcp://source;destination`` form, so
the subscriber sees it as another host.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest
import zmq
import zmq.asyncio
from prometheus_client import generate_latest

from router.config import Settings
from router.core import RouterCore
from router.events import EventsSettings, ReplayError, fetch_replay, make_topic
from router.events.ratelimit import reset as reset_log_limits
from router.fleet.pods import PodSpec
from router.fleet.scrape import MetricsScraper
from router.sim.events import EventFactory
from router.sim.pod import SimPod
from router.sim.settings import SimSettings
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
    dial_pods,
    payload,
    pod_of,
    stored,
)

END = (-1).to_bytes(8, "big", signed=True)
#: how long the flood test waits for its 20,000 messages to be handled
FLOOD_S = 120.0


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    reset_log_limits()
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


def link(seq: int) -> dict:
    """Batch ``seq`` of a long chain: block ``seq`` (hash seq + 1) under block seq - 1."""
    return stored(chain(1, start=seq * BS), [seq + 1], parent=seq if seq else None)


def long_chain(n: int) -> list[int]:
    return list(range(n * BS))


class ThreadedReplay:
    """vLLM's replay service (``ZmqEventPublisher._service_replay``): a ROUTER in its
    own thread answering a request with every buffered batch in one tight loop of
    non-blocking sends, on ZMQ's default send high-water mark."""

    def __init__(self, buffer: list[tuple[int, bytes]]) -> None:
        self.buffer = buffer
        self.requests: list[int] = []
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(50):
                continue
            client, _, start = self._sock.recv_multipart()
            start_seq = int.from_bytes(start, "big")
            self.requests.append(start_seq)
            for seq, body in self.buffer:
                if seq >= start_seq:
                    self._sock.send_multipart((client, b"", seq.to_bytes(8, "big"), body))
            self._sock.send_multipart((client, b"", END, b""))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(linger=0)
        self._ctx.term()


class TricklingReplay:
    """A replay ROUTER that sends the first batch asked for, then nothing until
    :attr:`release` is set (a dying pod, a congested link)."""

    def __init__(self, ctx: zmq.asyncio.Context, buffer: list[tuple[int, bytes]]) -> None:
        self.buffer = buffer
        self.asked = asyncio.Event()
        self.release = asyncio.Event()
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._task = asyncio.create_task(self._serve())

    async def _serve(self) -> None:
        client, _, start = await self.sock.recv_multipart()
        start_seq = int.from_bytes(start, "big")
        held = [(s, b) for s, b in self.buffer if s >= start_seq]
        await self.sock.send_multipart([client, b"", held[0][0].to_bytes(8, "big"), held[0][1]])
        self.asked.set()
        await self.release.wait()
        for seq, body in held[1:]:
            await self.sock.send_multipart([client, b"", seq.to_bytes(8, "big"), body])
        await self.sock.send_multipart([client, b"", END, b""])

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self.sock.close(linger=0)


@dataclass
class Facts:
    capacity_blocks: int | None
    block_size: int | None


# -- per-pod bounds --------------------------------------------------------------------


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


# -- replays off the writer's path -------------------------------------------------------


async def test_a_trickling_replay_socket_does_not_hold_up_other_pods(
    ctx: zmq.asyncio.Context,
) -> None:
    buffer = [(s, payload([link(s)])) for s in range(3)]
    trickle = TricklingReplay(ctx, buffer)
    try:
        async with dial_pods(
            ctx,
            ["slow", "fast"],
            replay_endpoints={"slow": trickle.endpoint},
            replay_timeout_s=60,
            replay_deadline_s=120,
        ) as (h, pubs):
            slow = pubs["slow"]
            await slow.send([link(0)])
            await slow.send([link(1)], publish=False)
            await slow.send([link(2)], publish=False)
            await slow.send([link(3)])  # a gap: replay 1..2 from the trickling socket
            await asyncio.wait_for(trickle.asked.wait(), 10)
            await pubs["fast"].send([stored(chain(2, start=5000), [70, 71])])
            # (no drain() here: it would wait for the replay)
            await wait_until(lambda: h.sub.stats.pod("fast").batches == 1)
            # the other pod's batch went in while the replay is still running
            assert not trickle.release.is_set()
            assert h.sub._feeds["slow"].replay is not None
            assert h.sub.stats.pod("slow").last_seq == 0
            hits = await h.index.lookup(h.hasher.keys(chain(2, start=5000)))
            assert hits["fast"]["GPU"] == 2
            trickle.release.set()
            await h.applied(4, "slow")
            st = h.sub.stats.pod("slow")
            assert (st.gaps, st.replays, st.replayed_batches, st.total_resyncs) == (1, 1, 2, 0)
            assert await h.blocks_held(long_chain(4), "slow") == 4
    finally:
        await trickle.close()


async def test_a_replay_that_trickles_past_its_deadline_fails(ctx: zmq.asyncio.Context) -> None:
    trickle = TricklingReplay(ctx, [(s, payload([])) for s in range(5)])
    try:
        with pytest.raises(ReplayError, match="deadline"):
            await fetch_replay(ctx, trickle.endpoint, 0, timeout_s=30, deadline_s=0.3)
    finally:
        await trickle.close()


async def test_a_5000_batch_replay_from_vllms_tight_send_loop_arrives_complete(
    ctx: zmq.asyncio.Context,
) -> None:
    """vLLM's replay ROUTER drops what exceeds its send high-water mark (1,000): the
    client resumes from the first missing seq until it has them all."""
    n = 5000
    server = ThreadedReplay([(s, payload([link(s)])) for s in range(n)])
    try:
        got = await fetch_replay(ctx, server.endpoint, 0)
        assert [b.seq for b in got] == list(range(n))
        assert got[1234].payload == server.buffer[1234][1]
        pub = VllmLikePublisher(ctx, make_topic("p", MODEL), replay=False)
        h = Harness(ctx, EventsSettings(mode="dial"))
        await h.sub.start()
        h.registry.set_pods(
            [
                PodSpec(
                    name="p",
                    url="http://127.0.0.1:1",
                    events_endpoint=pub.endpoint,
                    replay_endpoint=server.endpoint,
                )
            ]
        )
        try:
            await pub.subscribed()
            await pub.send([link(n)], seq=n)  # first seen: a join replay of 0..4999
            await h.applied(n + 1)
            st = h.sub.stats.pod("p")
            assert (st.replays, st.replayed_batches, st.total_resyncs) == (1, n, 0)
            assert await h.blocks_held(long_chain(n + 1)) == n + 1  # no link missing
        finally:
            await h.sub.stop()
            await pub.close()
    finally:
        server.close()


async def test_a_join_replay_with_a_hole_resyncs_and_relearns_the_tail(
    ctx: zmq.asyncio.Context,
) -> None:
    h = Harness(ctx, EventsSettings(mode="dial"))
    pub = VllmLikePublisher(ctx, make_topic("p", MODEL))
    for s in range(5):
        await pub.send([stored(chain(1, start=BS * 100 * s), [10 + s])], publish=False)
    pub.buffer = [e for e in pub.buffer if e[0] != 2]  # seq 2 missing from the replay
    stale = chain(2, start=BS * 900)
    await h.index.add("p", h.hasher.keys(stale))  # left by a previous writer
    await h.sub.start()
    try:
        h.registry.set_pods([pod_of(pub)])
        await pub.subscribed()
        await pub.send([stored(chain(1, start=BS * 500), [15])])  # seq 5
        await wait_until(lambda: h.sub.stats.pod("p").last_seq == 5)
        st = h.sub.stats.pod("p")
        assert pub.replay_requests == [0, 2]  # resumed at the hole, which stayed
        assert st.resyncs["join_gap"] == 1
        assert await h.blocks_held(stale) == 0  # the resync cleared what we cannot trust
        for s in (0, 1):  # before the hole: not applied
            assert await h.blocks_held(chain(1, start=BS * 100 * s)) == 0
        for s in (3, 4, 5):  # the consecutive tail, then the live batch
            assert await h.blocks_held(chain(1, start=BS * 100 * s)) == 1
    finally:
        await h.sub.stop()
        await pub.close()


async def test_a_join_replay_that_starts_later_than_asked_resyncs_like_a_gap(
    ctx: zmq.asyncio.Context,
) -> None:
    h = Harness(ctx, EventsSettings(mode="dial"))
    pub = VllmLikePublisher(ctx, make_topic("p", MODEL))
    for s in range(5):
        await pub.send([stored(chain(1, start=BS * 100 * s), [10 + s])], publish=False)
    pub.buffer = pub.buffer[3:]  # 0..2 aged out of the engine's buffer
    await h.index.add("p", h.hasher.keys(chain(1, start=BS * 900)))
    await h.sub.start()
    try:
        h.registry.set_pods([pod_of(pub)])
        await pub.subscribed()
        await pub.send([stored(chain(1, start=BS * 500), [15])])
        await wait_until(lambda: h.sub.stats.pod("p").last_seq == 5)
        await h.sub.drain()
        assert h.sub.stats.pod("p").resyncs["join_gap"] == 1
        assert await h.blocks_held(chain(1, start=BS * 900)) == 0
        assert await h.blocks_held(chain(1, start=BS * 300)) == 1
    finally:
        await h.sub.stop()
        await pub.close()


# -- who may speak for a pod -----------------------------------------------------------


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


# -- events that contradict the pod ------------------------------------------------------


async def test_batches_beyond_the_pods_cache_or_of_another_block_size_are_rejected(
    ctx: zmq.asyncio.Context,
) -> None:
    facts = Facts(capacity_blocks=8, block_size=BS)
    async with dial_pod(ctx) as (h, pub):
        h.sub.pod_facts = lambda pod: facts
        await pub.send([stored(chain(5), [1, 2, 3, 4, 5])])
        await h.applied(1)
        assert await h.blocks_held(chain(5)) == 5
        # 5 + 4 = 9 blocks held > 8: the stream contradicts the cache's size
        await pub.send([stored(chain(4, start=BS * 100), [11, 12, 13, 14])])
        await wait_until(lambda: h.sub.stats.pod("p").rejected["capacity"] == 1)
        await h.sub.drain()
        assert await h.blocks_held(chain(5)) == 0  # resynced
        assert await h.blocks_held(chain(4, start=BS * 100)) == 0
        wrong = stored(chain(1, start=BS * 200), [21])
        wrong["block_size"] = 2 * BS
        wrong["token_ids"] = chain(2, start=BS * 200)
        await pub.send([wrong])
        await wait_until(lambda: h.sub.stats.pod("p").rejected["block_size"] == 1)
        await pub.send([stored(chain(3, start=BS * 300), [31, 32, 33])])
        await h.applied(2)
        st = h.sub.stats.pod("p")
        assert st.resyncs["rejected"] == 2 and st.gaps == 0
        assert await h.blocks_held(chain(3, start=BS * 300)) == 3
        text = generate_latest(h.metrics).decode()
        assert 'kvroute_event_rejected_total{pod="p",reason="capacity"} 1.0' in text
        assert 'kvroute_event_resyncs_total{pod="p",reason="rejected"} 2.0' in text


async def test_a_sim_pod_whose_stream_claims_more_blocks_than_its_cache_is_rejected(
    ctx: zmq.asyncio.Context,
) -> None:
    """Facts from the pod's real /metrics; a cache filled by real traffic (evictions and
    all) is never rejected; one forged message claiming 40 blocks on a 16-block cache
    is."""
    pod = SimPod(
        SimSettings(
            model=MODEL, pod_name="sim-0", block_size=BS, capacity_tokens=16 * BS, time_scale=0.0
        )
    )
    await pod.start()
    h = Harness(ctx, EventsSettings(mode="dial"))
    client = httpx.AsyncClient(timeout=10)
    scraper = MetricsScraper(h.registry, client, interval_s=60, timeout_s=5, stale_after_s=60)
    h.sub.pod_facts = scraper.cache_config
    await h.sub.start()
    h.registry.set_pods(
        [
            PodSpec(
                name=pod.name,
                url=pod.url,
                events_endpoint=pod.events_endpoint,
                replay_endpoint=pod.replay_endpoint_url,
                models=(MODEL,),
            )
        ]
    )
    try:
        await scraper.scrape_all()
        facts = scraper.cache_config(pod.name)
        assert facts is not None and (facts.capacity_blocks, facts.block_size) == (16, BS)
        for i in range(12):  # 12 prompts x 3 blocks through a 16-block cache
            r = await client.post(
                f"{pod.url}/v1/completions",
                json={"model": MODEL, "prompt": f"prompt {i:02d} " * 6, "max_tokens": 1},
            )
            r.raise_for_status()
        await wait_until(lambda: h.sub.stats.pod(pod.name).batches >= 12)
        await h.sub.drain()
        st = h.sub.stats.pod(pod.name)
        assert not st.rejected and st.total_resyncs == 0
        held = h.sink.applier.pod(pod.name)
        assert held is not None and 0 < held.gpu_blocks <= 16
        forged = EventFactory("map").stored(
            list(range(1, 41)),
            None,
            list(range(40 * BS)),
            BS,
            lora_id=None,
            lora_name=None,
            extra_keys=[],
        )
        assert pod.publisher is not None
        pod.publisher.publish([forged])
        await wait_until(lambda: st.rejected["capacity"] == 1)
        await h.sub.drain()
        assert await h.blocks_held(list(range(40 * BS)), pod.name) == 0
    finally:
        await h.sub.stop()
        await client.aclose()
        await pod.stop()


# -- the index-entries gauge -------------------------------------------------------------


async def test_the_index_entries_gauge_drops_to_zero_when_a_pod_is_cleared() -> None:
    core = RouterCore(Settings())
    try:
        core.registry.set_pods([PodSpec(name=n, url="http://127.0.0.1:1") for n in ("a", "b")])
        keys = BlockHasher(BS, MODEL).keys(chain(3))
        await core.index.add("a", keys)
        await core.index.add("b", keys[:1])
        await core.update_index_gauge()
        text = core.metrics.render().decode()
        assert 'kvroute_index_entries{pod="a"} 3.0' in text
        await core.index.clear_pod("a")  # what a resync does
        await core.update_index_gauge()
        text = core.metrics.render().decode()
        assert 'kvroute_index_entries{pod="a"} 0.0' in text
        assert 'kvroute_index_entries{pod="b"} 1.0' in text
    finally:
        await core.stop()
