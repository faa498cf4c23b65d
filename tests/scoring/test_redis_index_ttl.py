"""RedisIndex's slot TTL: refreshed by adds, stale slots ignored then swept, the grace
period of a slot's hash (real server).
"""

from __future__ import annotations

import redis.asyncio as aioredis

from scoring.index import redis_lua
from scoring.index.redis import RedisIndex
from tests.scoring.redis_index_support import hints_name, slot_name
from tests.scoring.redis_index_support import index as index  # the fixture
from tests.scoring.redis_index_support import raw as raw  # the fixture


async def test_add_sets_and_refreshes_the_slot_ttl(
    redis_url: str, redis_namespace: str, raw: aioredis.Redis
) -> None:
    idx = RedisIndex.from_url(redis_url, namespace=redis_namespace, ttl_s=600)
    try:
        await idx.add("pod-a", [9])
        slot = await slot_name(raw, redis_namespace, "pod-a")
        await raw.pexpire(slot, 5_000)
        await idx.add("pod-a", [10])  # any add to the slot refreshes it
        assert await raw.pttl(slot) > 5_000
        await raw.pexpire(slot, 5_000)
        await idx.remove("pod-a", [10])  # a remove does not extend it
        assert 0 < await raw.pttl(slot) <= 5_000
        # hints carry no TTL: a block stored once and then only hit stays findable
        assert await raw.pttl(hints_name(redis_namespace)) == -1
    finally:
        await idx.close()


async def test_ttl_zero_stores_slots_without_expiry(
    redis_url: str, redis_namespace: str, raw: aioredis.Redis
) -> None:
    idx = RedisIndex.from_url(redis_url, namespace=redis_namespace, ttl_s=0)
    try:
        await idx.add("pod-a", [9])
        assert await raw.pttl(await slot_name(raw, redis_namespace, "pod-a")) == -1
    finally:
        await idx.close()


async def test_a_pod_that_stored_nothing_for_ttl_is_ignored_then_swept(
    index: RedisIndex, raw: aioredis.Redis, redis_namespace: str
) -> None:
    await index.add("pod-a", [1, 2, 3, 4])
    await index.add("pod-b", [1, 2])
    slot = await slot_name(raw, redis_namespace, "pod-a")
    prefix = b"{" + redis_namespace.encode() + b"}:"
    # as if pod-a's last add was ttl_s ago (it vanished without a clear_pod)
    await raw.hset(prefix + b"seen", slot.removeprefix(prefix + b"s"), 0)
    assert await index.lookup([1, 2, 3, 4]) == {"pod-b": {"GPU": 2, "CPU": 2, "DISK": 2}}
    assert await index.lookup([1, 2], pods=["pod-a"]) == {}
    assert await index.pod_entries() == {"pod-b": 2}
    assert await index.sweep() == 4  # the stale slot's hint fields
    assert await raw.exists(slot) == 0  # its hash is unlinked
    assert await raw.hget(prefix + b"p:GPU", b"pod-a") is None  # and it is retired
    assert await index.block_keys() == 2
    await index.add("pod-a", [1])  # a fresh generation
    assert (await index.lookup([1]))["pod-a"] == {"GPU": 1, "CPU": 1, "DISK": 1}


async def test_a_pod_storing_again_after_its_slot_expired_gets_a_fresh_generation(
    index: RedisIndex, raw: aioredis.Redis, redis_namespace: str
) -> None:
    """Hints of the expired slot must not count again (the walk reads hints while more
    than 8 pods are in, so 10 pods share the chain)."""
    pods = [f"pod-{i}" for i in range(10)]
    await index.apply_ops([("add", p, "GPU", [1, 2, 3]) for p in pods])
    await raw.delete(await slot_name(raw, redis_namespace, "pod-0"))  # expired
    await index.add("pod-0", [1])
    hits = await index.lookup([1, 2, 3])
    assert hits["pod-0"] == {"GPU": 1, "CPU": 1, "DISK": 1}
    assert hits["pod-9"] == {"GPU": 3, "CPU": 3, "DISK": 3}


async def test_a_slot_hash_outlives_its_ttl_by_a_grace_period(
    redis_url: str, redis_namespace: str, raw: aioredis.Redis
) -> None:
    """While a slot is live by its last-add stamp, its hash is guaranteed to exist."""
    idx = RedisIndex.from_url(redis_url, namespace=redis_namespace, ttl_s=600)
    try:
        await idx.add("pod-a", [9])
        slot = await slot_name(raw, redis_namespace, "pod-a")
        assert 600_000 < await raw.pttl(slot) <= (600 + redis_lua.SLOT_GRACE_S) * 1000
    finally:
        await idx.close()
