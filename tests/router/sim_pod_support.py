"""Fixtures and helpers for speaking to the simulated vLLM pod as the router speaks to a
real one (the ``test_sim_pod_*.py`` and ``test_sim_pd.py`` files): pods started and stopped
per test, an HTTP client, SUB sockets decoding batches with plain msgspec, polling, request
bodies and Prometheus samples.  Delays are off (time_scale=0) unless a test asks.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio

from router.sim import SimPod, SimSettings

MakePod = Callable[..., Awaitable[SimPod]]
GUARD = 10.0  # seconds: a failure guard for receives, never a speed assertion


@pytest.fixture
async def make_pod() -> AsyncIterator[MakePod]:
    pods: list[SimPod] = []

    async def make(**kw: Any) -> SimPod:
        kw.setdefault("time_scale", 0)
        pod = SimPod(SimSettings(**kw))
        await pod.start()
        pods.append(pod)
        return pod

    yield make
    for pod in pods:
        await pod.stop()


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=GUARD) as client:
        yield client


class Sub:
    """A SUB socket and the batches it receives, decoded with plain msgspec."""

    def __init__(self, sock: zmq.asyncio.Socket) -> None:
        self.sock = sock

    async def recv(self) -> tuple[bytes, int, list[Any]]:
        topic, seq, payload = await asyncio.wait_for(self.sock.recv_multipart(), GUARD)
        return topic, int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)

    async def events(self) -> list[Any]:
        """The events of the next batch."""
        _, _, batch = await self.recv()
        return list(batch[1])

    async def sync(self, pod: SimPod) -> None:
        """Wait until the subscription is live (PUB drops messages before that):
        publish AllBlocksCleared probes until one arrives, then drain the rest."""
        assert pod.publisher is not None
        while True:
            pod.reset_prefix_cache()
            with contextlib.suppress(TimeoutError):
                _, seq, _ = await asyncio.wait_for(self.recv(), 0.1)
                break
        last = pod.publisher.next_seq - 1
        while seq < last:
            _, seq, _ = await self.recv()


@pytest.fixture
async def subscribe() -> AsyncIterator[Callable[[SimPod], Awaitable[Sub]]]:
    ctx = zmq.asyncio.Context.instance()
    socks: list[zmq.asyncio.Socket] = []

    async def make(pod: SimPod) -> Sub:
        assert pod.events_endpoint is not None
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(pod.events_endpoint)
        socks.append(sock)
        sub = Sub(sock)
        await sub.sync(pod)
        return sub

    yield make
    for s in socks:
        s.close(linger=0)


async def until(cond: Callable[[], bool]) -> None:
    """Poll for a state (not a speed): fail only if it never comes within GUARD."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + GUARD
    while not cond():
        assert loop.time() < deadline, "state not reached"
        await asyncio.sleep(0.01)


def chat_body(text: str, **kw: Any) -> dict[str, Any]:
    return {"model": "sim-model", "messages": [{"role": "user", "content": text}], **kw}


LONG = "Tell me everything about the prefix cache of a vLLM engine. " * 3  # 180 bytes


async def tokenize(http: httpx.AsyncClient, pod: SimPod, body: dict[str, Any]) -> list[int]:
    r = await http.post(f"{pod.url}/tokenize", json=body)
    assert r.status_code == 200, r.text
    return list(r.json()["tokens"])


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus exposition."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        sample, _, rest = head.partition("{")
        if sample != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            return float(value)
    raise AssertionError(f"{name} {labels} not in metrics")
