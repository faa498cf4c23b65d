"""Fixtures and helpers shared by the ``test_redis_index_*.py`` files (RedisIndex and
RedisLoadStore against a real server): raw clients, the index and load stores of a test's
namespace, the names of the Redis keys, and a round-trip counter.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from scoring.index.redis import RedisIndex, RedisLoadStore


@pytest.fixture
async def raw(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url, decode_responses=False)
    yield client
    await client.aclose()


@pytest.fixture
async def index(redis_url: str, redis_namespace: str) -> AsyncIterator[RedisIndex]:
    idx = RedisIndex.from_url(
        redis_url, namespace=redis_namespace, connection_class=CountingConnection
    )
    yield idx
    await idx.close()


def hints_name(namespace: str) -> bytes:
    """The namespace's hash of holder hints (field: a block key as 8 big-endian bytes)."""
    return b"{" + namespace.encode() + b"}:h"


async def hint(raw: aioredis.Redis, namespace: str, key: int) -> bytes | None:
    """The holder hint of one block (None when no slot holds it)."""
    value = await raw.hget(hints_name(namespace), struct.pack(">Q", key))
    assert value is None or isinstance(value, bytes)
    return value


async def slot_name(raw: aioredis.Redis, namespace: str, pod: str, tier: str = "GPU") -> bytes:
    """The hash of the pod's current slot (generation) in ``tier``."""
    prefix = b"{" + namespace.encode() + b"}:"
    slot_id = await raw.hget(prefix + b"p:" + tier.encode(), pod.encode())
    assert isinstance(slot_id, bytes), f"{pod} has no slot in {tier}"
    return prefix + b"s" + slot_id


class CountingConnection(aioredis.Connection):
    """A real connection that counts its writes: one write = one round trip."""

    writes = 0

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        type(self).writes += 1
        await super().send_packed_command(command, check_health)


async def round_trips(coro: Awaitable[object]) -> int:
    """How many request writes the index made while awaiting ``coro``."""
    before = CountingConnection.writes
    await coro
    return CountingConnection.writes - before


LoadStores = Callable[..., RedisLoadStore]


@pytest.fixture
async def load_store(redis_url: str, redis_namespace: str) -> AsyncIterator[LoadStores]:
    """Make load stores (router replicas) on this test's namespace; closed at the end."""
    stores: list[RedisLoadStore] = []

    def make(**kwargs: Any) -> RedisLoadStore:
        store = RedisLoadStore.from_url(redis_url, namespace=redis_namespace, **kwargs)
        stores.append(store)
        return store

    yield make
    for store in stores:
        await store.close()  # idempotent: a test may have closed it already


class SwallowsCancel:
    """Fault injection: a command in flight that swallows the task's cancellation, as
    redis-py can do (the command returns instead of raising CancelledError)."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self._released = asyncio.Event()

    async def call(self, *args: object, **kwargs: object) -> int:
        self.entered.set()
        if self._released.is_set():
            raise asyncio.CancelledError()
        with contextlib.suppress(asyncio.CancelledError):
            await self._released.wait()
        return 0

    def release(self) -> None:
        """End the fault: later calls raise, so a loop that lost its cancel ends too."""
        self._released.set()
