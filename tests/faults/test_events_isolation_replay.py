"""Isolated KV-event ingestion (issue #10), replays off the writer's path: a trickling or
dead replay socket holds up no other pod, a 5,000-batch replay from vLLM's tight send loop
arrives complete, join replays with holes resync.

Real ZMQ sockets on loopback: vLLM-like publishers (:mod:`tests.support.kv_events`) and a
replay ROUTER served from a thread in a tight loop of non-blocking sends exactly as vLLM's
publisher thread does.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading

import pytest
import zmq
import zmq.asyncio

from router.events import EventsSettings, ReplayError, fetch_replay, make_topic
from router.fleet.pods import PodSpec
from tests.faults.events_isolation_support import ctx as ctx  # the fixture
from tests.support.aio import wait_until
from tests.support.kv_events import (
    BS,
    MODEL,
    Harness,
    VllmLikePublisher,
    chain,
    dial_pods,
    payload,
    pod_of,
    stored,
)

END = (-1).to_bytes(8, "big", signed=True)


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
