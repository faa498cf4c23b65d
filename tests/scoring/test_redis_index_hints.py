"""RedisIndex's holder hints and digests: functions of the holder set alone, whatever the
order of writes (real server).
"""

from __future__ import annotations

import struct

import redis.asyncio as aioredis

from scoring.index.redis import RedisIndex
from tests.scoring.redis_index_support import hint
from tests.scoring.redis_index_support import index as index  # the fixture
from tests.scoring.redis_index_support import raw as raw  # the fixture


async def test_holder_hints_are_sorted_ids_so_equal_sets_give_equal_hints(
    index: RedisIndex, raw: aioredis.Redis, redis_namespace: str
) -> None:
    pods = [f"pod-{i}" for i in range(5)]
    for pod in pods:
        await index.add(pod, [1])
    for pod in reversed(pods):
        await index.add(pod, [2])
    one = await hint(raw, redis_namespace, 1)
    assert isinstance(one, bytes)
    assert one == await hint(raw, redis_namespace, 2)
    ids = struct.unpack(">5I", one)
    assert list(ids) == sorted(ids)
    await index.remove("pod-2", [2])
    assert len(await hint(raw, redis_namespace, 2) or b"") == 16


async def digest(raw: aioredis.Redis, namespace: str, key: int) -> bytes | None:
    value = await raw.hget(b"{" + namespace.encode() + b"}:d", struct.pack(">Q", key))
    assert value is None or isinstance(value, bytes)
    return value


async def test_equal_holder_sets_have_equal_digests_whatever_the_order_of_writes(
    index: RedisIndex, raw: aioredis.Redis, redis_namespace: str
) -> None:
    """The walk compares digests, so they must be a function of the holder set alone:
    kept incrementally by add / remove, recomputed by the sweep, they agree."""
    pods = [f"pod-{i}" for i in range(6)]
    for pod in pods:
        await index.add(pod, [1])
    for pod in reversed(pods):
        await index.add(pod, [2, 3])
    await index.add("pod-x", [2])
    await index.remove("pod-x", [2])
    await index.remove("pod-3", [3])
    await index.add("pod-3", [3])
    d1 = await digest(raw, redis_namespace, 1)
    assert d1 is not None and d1.startswith(b"6:")
    assert d1 == await digest(raw, redis_namespace, 2) == await digest(raw, redis_namespace, 3)
    await index.remove("pod-1", [2])
    d2 = await digest(raw, redis_namespace, 2)
    assert d2 is not None and d2.startswith(b"5:") and d2 != d1
    await index.add("pod-7", [4])
    await index.add("pod-1", [4])  # a set of 2, written in another order
    await index.clear_pod("pod-7")
    await index.clear_pod("pod-1")
    await index.sweep()  # block 1 loses pod-1 by the sweep, block 2 lost it by a remove
    assert await digest(raw, redis_namespace, 1) == d2
    assert await digest(raw, redis_namespace, 4) is None
    assert await hint(raw, redis_namespace, 4) is None
    for pod in pods[:1] + pods[2:]:
        await index.remove(pod, [1, 2, 3])
    for key in (1, 2, 3):
        assert await digest(raw, redis_namespace, key) is None
        assert await hint(raw, redis_namespace, key) is None
