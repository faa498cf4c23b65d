"""Several RedisIndex replicas on one server: one shared index per namespace, namespaces
isolated, lookups served by a read-only replica (real servers).
"""

from __future__ import annotations

import struct

import pytest
import redis.asyncio as aioredis

from scoring.index import redis_lua
from scoring.index.breaker import SharedStateUnavailable
from scoring.index.redis import RedisIndex
from tests.scoring.redis_index_support import index as index  # the fixture
from tests.scoring.redis_index_support import raw as raw  # the fixture
from tests.support.aio import wait_until


async def test_replicas_sharing_a_namespace_see_one_index(
    redis_url: str, redis_namespace: str
) -> None:
    indexer = RedisIndex.from_url(redis_url, namespace=redis_namespace)
    replica_1 = RedisIndex.from_url(redis_url, namespace=redis_namespace)
    replica_2 = RedisIndex.from_url(redis_url, namespace=redis_namespace)
    try:
        await indexer.add("pod-a", [1, 2, 3])
        await replica_1.add("pod-b", [1, 2])
        expect = {
            "pod-a": {"GPU": 3, "CPU": 3, "DISK": 3},
            "pod-b": {"GPU": 2, "CPU": 2, "DISK": 2},
        }
        assert await replica_1.lookup([1, 2, 3]) == expect
        assert await replica_2.lookup([1, 2, 3]) == expect
        await replica_2.clear_pod("pod-a")
        assert await indexer.lookup([1, 2, 3]) == {"pod-b": {"GPU": 2, "CPU": 2, "DISK": 2}}
    finally:
        for idx in (indexer, replica_1, replica_2):
            await idx.close()


async def test_namespaces_are_isolated(redis_url: str, redis_namespace: str) -> None:
    a = RedisIndex.from_url(redis_url, namespace=redis_namespace + "-a")
    b = RedisIndex.from_url(redis_url, namespace=redis_namespace + "-b")
    try:
        await a.add("pod-a", [1, 2])
        assert await b.lookup([1, 2]) == {}
        assert await b.pod_entries() == {}
        await b.clear_pod("pod-a")
        assert await a.lookup([1, 2]) == {"pod-a": {"GPU": 2, "CPU": 2, "DISK": 2}}
    finally:
        await a.close()
        await b.close()


async def test_the_lookup_script_is_read_only(
    index: RedisIndex, raw: aioredis.Redis, redis_namespace: str
) -> None:
    """Flagged no-writes: EVAL_RO accepts it (so read replicas may serve lookups)."""
    await index.add("pod-a", [1, 2, 3])

    ns = b"{" + redis_namespace.encode() + b"}:"
    reply = await raw.eval_ro(
        redis_lua.LOOKUP,
        7,
        ns + b"ids",
        ns + b"seen",
        ns + b"h",
        ns + b"d",
        ns + b"p:GPU",
        ns + b"p:CPU",
        ns + b"p:DISK",
        ns,
        struct.pack(">3Q", 1, 2, 3),
        b"0",
    )
    assert reply == [b"pod-a", b"3,3,3"]
    with pytest.raises(aioredis.ResponseError, match=r"(?i)write"):
        await raw.eval_ro(
            redis_lua.ADD,
            6,
            ns + b"p:GPU",
            ns + b"ids",
            ns + b"next",
            ns + b"seen",
            ns + b"h",
            ns + b"d",
            ns,
            b"pod-x",
            b"GPU",
            b"0",
            struct.pack(">Q", 1),
        )


async def test_a_read_only_replica_serves_lookups_and_refuses_writes(
    index: RedisIndex, redis_replica_url: str, redis_namespace: str
) -> None:
    await index.add("pod-a", [1, 2, 3])
    await index.add("pod-b", [1])
    await index.clear_pod("pod-z")  # bumps the namespace's state once more
    replica = RedisIndex.from_url(redis_replica_url, namespace=redis_namespace)
    expect = {
        "pod-a": {"GPU": 3, "CPU": 3, "DISK": 3},
        "pod-b": {"GPU": 1, "CPU": 1, "DISK": 1},
    }
    try:

        async def caught_up() -> bool:
            try:
                return await replica.lookup([1, 2, 3]) == expect
            except (aioredis.ConnectionError, aioredis.ResponseError, SharedStateUnavailable):
                return False  # still syncing (LOADING / MASTERDOWN; the guard wraps LOADING)

        await wait_until(caught_up, "the replica to sync")
        assert await replica.lookup([1, 2, 3], pods=["pod-b"]) == {"pod-b": expect["pod-b"]}
        assert await replica.pod_entries() == {"pod-a": 3, "pod-b": 1}
        with pytest.raises(aioredis.ResponseError, match=r"(?i)read.only|readonly"):
            await replica.add("pod-c", [1])
    finally:
        await replica.close()
