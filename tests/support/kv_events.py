"""KV-event test kit: a publisher speaking vLLM's wire format on real ZMQ sockets, and
a subscriber harness over a real in-memory index (tests/router/test_events_*.py).

:class:`VllmLikePublisher` is an XPUB (on the wire the same as vLLM's PUB; it also
tells the test when the subscription has arrived, so no batch is lost to ZMQ's
slow-joiner window) sending ``[topic, seq (8 bytes BE), msgpack([ts, [events],
dp_rank])]``, and a ROUTER answering replay requests ``[b"", start_seq]`` with
``[b"", seq, payload]`` per buffered batch and an end marker of seq -1.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio
from prometheus_client import CollectorRegistry

from router.events import EventsSettings, IndexSink, KVEventSubscriber, make_topic
from router.fleet.pods import PodRegistry, PodSpec
from scoring.blocks import BlockHasher
from scoring.index.memory import InMemoryIndex
from tests.support.aio import wait_until

MODEL = "m"
BS = 4  # block size of these tests


def stored(tokens: Sequence[int], hashes: Sequence[int], parent: int | None = None) -> dict:
    return {
        "type": "BlockStored",
        "block_hashes": list(hashes),
        "parent_block_hash": parent,
        "token_ids": list(tokens),
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


def removed(hashes: Sequence[int]) -> dict:
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": "GPU"}


def payload(events: list[dict], ts: float | None = None) -> bytes:
    return msgspec.msgpack.encode([time.time() if ts is None else ts, events, 0])


def chain(n_blocks: int, start: int = 0) -> list[int]:
    return list(range(start, start + n_blocks * BS))


class VllmLikePublisher:
    """vLLM's PUB + replay ROUTER, with a seq the test can steer."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        topic: str = "",
        *,
        connect_to: str | None = None,
        replay: bool = True,
        bind_to: str = "tcp://127.0.0.1:*",
        replay_bind_to: str = "tcp://127.0.0.1:*",
    ) -> None:
        self.topic = topic.encode()
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 100_000)  # vLLM's PUB (ZmqEventPublisher hwm)
        self.endpoint: str | None = None
        if connect_to:
            self.pub.connect(connect_to)
        else:
            self.pub.bind(bind_to)
            self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0
        self.replay_requests: list[int] = []
        self.router: zmq.asyncio.Socket | None = None
        self.replay_endpoint: str | None = None
        self._task: asyncio.Task[None] | None = None
        if replay:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
            try:
                self.router.bind(replay_bind_to)
            except zmq.ZMQError:
                self.router.close(linger=0)
                self.pub.close(linger=0)
                raise
            self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._task = asyncio.create_task(self._serve_replay())

    async def subscribed(self) -> None:
        """Wait for a subscriber's subscription message."""
        msg = await asyncio.wait_for(self.pub.recv(), 10)
        assert msg[:1] == b"\x01"

    async def send(
        self, events: list[dict], *, seq: int | None = None, publish: bool = True
    ) -> int:
        """Buffer (for replay) and, unless ``publish=False`` (lost), send one batch."""
        seq = self.seq if seq is None else seq
        body = payload(events)
        self.buffer.append((seq, body))
        if publish:
            await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), body])
        self.seq = seq + 1
        return seq

    async def send_raw(self, frames: list[bytes]) -> None:
        await self.pub.send_multipart(frames)

    async def _serve_replay(self) -> None:
        assert self.router is not None
        while True:
            client, _, start = await self.router.recv_multipart()
            start_seq = int.from_bytes(start, "big")
            self.replay_requests.append(start_seq)
            for seq, body in self.buffer:
                if seq >= start_seq:
                    await self.router.send_multipart([client, b"", seq.to_bytes(8, "big"), body])
            await self.router.send_multipart(
                [client, b"", (-1).to_bytes(8, "big", signed=True), b""]
            )

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.router is not None:
            self.router.close(linger=0)
        self.pub.close(linger=0)


class Harness:
    def __init__(self, ctx: zmq.asyncio.Context, settings: EventsSettings) -> None:
        self.ctx = ctx
        self.index = InMemoryIndex()
        self.sink = IndexSink(self.index)
        self.registry = PodRegistry()
        self.metrics = CollectorRegistry()
        self.sub = KVEventSubscriber(
            settings, self.registry, self.sink, metrics_registry=self.metrics, context=ctx
        )
        self.hasher = BlockHasher(BS, MODEL)

    async def blocks_held(self, tokens: Sequence[int], pod: str = "p") -> int:
        await self.sub.drain()
        hits = await self.index.lookup(self.hasher.keys(tokens))
        return hits.get(pod, {}).get("GPU", 0)

    async def applied(self, n: int, pod: str = "p", *, timeout: float = 20.0) -> None:
        await wait_until(lambda: self.sub.stats.pod(pod).batches >= n, timeout=timeout)
        await self.sub.drain()


def pod_of(pub: VllmLikePublisher, name: str = "p", **extra: Any) -> PodSpec:
    """The pod ``name`` whose events (and replay) ``pub`` publishes."""
    return PodSpec(
        name=name,
        url="http://127.0.0.1:1",
        events_endpoint=pub.endpoint,
        replay_endpoint=pub.replay_endpoint,
        **extra,
    )


@contextlib.asynccontextmanager
async def dial_pod(
    ctx: zmq.asyncio.Context, *, replay: bool = True, **settings: Any
) -> AsyncIterator[tuple[Harness, VllmLikePublisher]]:
    """A subscriber in dial mode and one publisher registered as pod "p"."""
    h = Harness(ctx, EventsSettings(mode="dial", **settings))
    pub = VllmLikePublisher(ctx, make_topic("p", MODEL), replay=replay)
    await h.sub.start()
    h.registry.set_pods([pod_of(pub, models=(MODEL,))])
    await pub.subscribed()
    try:
        yield h, pub
    finally:
        await h.sub.stop()
        await pub.close()


@contextlib.asynccontextmanager
async def dial_pods(
    ctx: zmq.asyncio.Context,
    names: Sequence[str],
    *,
    replay_endpoints: dict[str, str] | None = None,
    **settings: Any,
) -> AsyncIterator[tuple[Harness, dict[str, VllmLikePublisher]]]:
    """A subscriber in dial mode and one publisher per name, registered as those pods;
    ``replay_endpoints`` replaces a pod's own replay ROUTER with another endpoint."""
    h = Harness(ctx, EventsSettings(mode="dial", **settings))
    pubs = {n: VllmLikePublisher(ctx, make_topic(n, MODEL)) for n in names}
    await h.sub.start()
    other = replay_endpoints or {}
    h.registry.set_pods(
        [
            PodSpec(
                name=n,
                url="http://127.0.0.1:1",
                events_endpoint=p.endpoint,
                replay_endpoint=other.get(n, p.replay_endpoint),
                models=(MODEL,),
            )
            for n, p in pubs.items()
        ]
    )
    for p in pubs.values():
        await p.subscribed()
    try:
        yield h, pubs
    finally:
        await h.sub.stop()
        for p in pubs.values():
            await p.close()


class StalledIndex:
    """A real in-memory index behind the async BlockIndex API only, whose writes wait
    for :attr:`gate` (think: a Redis hiccup)."""

    def __init__(self, inner: InMemoryIndex) -> None:
        self.inner = inner
        self.tiers = inner.tiers
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()

    async def add(self, pod: str, keys: Sequence[int], tier: str = "GPU") -> None:
        self.entered.set()
        await self.gate.wait()
        await self.inner.add(pod, keys, tier)

    async def remove(self, pod: str, keys: Sequence[int], tier: str = "GPU") -> None:
        await self.inner.remove(pod, keys, tier)

    async def clear_pod(self, pod: str, tier: str | None = None) -> None:
        await self.inner.clear_pod(pod, tier)

    async def lookup(self, keys: Sequence[int], pods: Any = None) -> Any:
        return await self.inner.lookup(keys, pods)

    async def pod_entries(self) -> dict[str, int]:
        return await self.inner.pod_entries()

    async def close(self) -> None:
        await self.inner.close()


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    """A ZMQ context for the test, destroyed (linger 0) after it."""
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)
