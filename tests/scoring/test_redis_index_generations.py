"""RedisIndex's counting to zero, slot generations, clearing and the sweep of retired
generations (real server).
"""

from __future__ import annotations

import asyncio
import struct

import pytest
import redis.asyncio as aioredis

from scoring.index.redis import RedisIndex
from tests.scoring.redis_index_support import SwallowsCancel, hint, round_trips, slot_name
from tests.scoring.redis_index_support import index as index  # the fixture
from tests.scoring.redis_index_support import raw as raw  # the fixture
from tests.support.aio import wait_until


async def test_an_entry_removed_to_zero_deletes_its_slot_field_and_hint(
    index: RedisIndex, raw: aioredis.Redis, redis_namespace: str
) -> None:
    await index.add("pod-a", [7])
    await index.add("pod-a", [7])
    await index.remove("pod-a", [7])
    slot = await slot_name(raw, redis_namespace, "pod-a")
    assert await raw.hget(slot, struct.pack(">Q", 7)) == b"1"
    await index.remove("pod-a", [7])
    assert not await raw.hexists(slot, struct.pack(">Q", 7))
    assert await hint(raw, redis_namespace, 7) is None
    await index.remove("pod-a", [7])  # unknown now: ignored, never negative
    assert not await raw.hexists(slot, struct.pack(">Q", 7))
    assert await index.lookup([7]) == {}
    assert await index.pod_entries() == {}


async def test_slot_and_registry_hashes_are_hashtables_even_when_small(
    index: RedisIndex, raw: aioredis.Redis, redis_namespace: str
) -> None:
    """A listpack answers HMGET in O(fields x entries): the walk needs hashtables."""
    await index.add("pod-a", [1, 2])
    prefix = b"{" + redis_namespace.encode() + b"}:"
    for key in (
        await slot_name(raw, redis_namespace, "pod-a"),
        prefix + b"p:GPU",
        prefix + b"ids",
        prefix + b"seen",
    ):
        assert await raw.object("encoding", key) == b"hashtable", key
    assert await index.pod_entries() == {"pod-a": 2}


async def test_clear_pod_hides_entries_at_once_without_scanning(
    index: RedisIndex, raw: aioredis.Redis, redis_namespace: str
) -> None:
    await index.add("pod-a", list(range(500)))
    await index.add("pod-b", list(range(10)))
    await index.clear_pod("pod-c")  # warm the script cache
    slot = await slot_name(raw, redis_namespace, "pod-a")
    before = (await raw.info("commandstats")).get("cmdstat_scan", {}).get("calls", 0)
    assert await round_trips(index.clear_pod("pod-a")) == 1
    after = (await raw.info("commandstats")).get("cmdstat_scan", {}).get("calls", 0)
    assert after == before  # the script retires two ids per tier; it never scans
    assert await index.lookup(list(range(500))) == {"pod-b": {"GPU": 10, "CPU": 10, "DISK": 10}}
    assert await index.pod_entries() == {"pod-b": 10}
    assert await raw.exists(slot) == 0  # the slot's hash is unlinked
    # its holder hints (4 bytes per holder) stay until a sweep, invisible meanwhile
    assert len(await hint(raw, redis_namespace, 400) or b"") == 4


async def test_a_cleared_pod_starts_a_fresh_generation(index: RedisIndex) -> None:
    await index.add("pod-a", [1, 2, 3])
    await index.add("pod-a", [1, 2, 3])
    await index.clear_pod("pod-a")
    await index.add("pod-a", [1, 2])
    assert await index.pod_entries() == {"pod-a": 2}
    await index.remove("pod-a", [1, 2])  # one copy each in the new generation
    assert await index.lookup([1, 2, 3]) == {}


async def test_clearing_one_tier_keeps_the_others(index: RedisIndex) -> None:
    await index.add("pod-a", [1, 2, 3, 4])
    await index.add("pod-a", [1, 2, 3, 4, 5, 6], tier="CPU")
    await index.clear_pod("pod-a", tier="GPU")
    assert await index.lookup([1, 2, 3, 4, 5, 6]) == {"pod-a": {"GPU": 0, "CPU": 6, "DISK": 6}}


async def test_sweep_deletes_only_retired_generations(
    index: RedisIndex, raw: aioredis.Redis, redis_namespace: str
) -> None:
    await index.add("pod-a", list(range(300)))
    await index.add("pod-b", list(range(100)))
    await index.clear_pod("pod-a")
    assert await index.sweep(count=50) == 300
    assert await index.block_keys() == 100  # keys held only by pod-a are gone
    assert len(await hint(raw, redis_namespace, 5) or b"") == 4  # pod-b's id only
    assert await index.lookup(list(range(100))) == {"pod-b": {"GPU": 100, "CPU": 100, "DISK": 100}}
    assert await index.sweep() == 0


async def test_sweep_forever_cleans_retired_ids_in_the_background(
    index: RedisIndex, raw: aioredis.Redis, redis_namespace: str
) -> None:
    await index.add("pod-a", [1, 2])
    await index.add("pod-b", [1])
    await index.clear_pod("pod-a")
    task = asyncio.get_running_loop().create_task(index.sweep_forever(interval_s=0.01))
    try:

        async def cleaned() -> bool:
            return index.swept == 2

        await wait_until(cleaned, "the background sweep")
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    assert len(await hint(raw, redis_namespace, 1) or b"") == 4  # pod-b only
    assert await hint(raw, redis_namespace, 2) is None
    assert index.sweep_errors == 0
    with pytest.raises(ValueError, match="interval_s must be positive"):
        await index.sweep_forever(interval_s=0)


async def test_the_sweep_loop_ends_when_cancelled_even_if_the_client_swallows_it(
    index: RedisIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    swallow = SwallowsCancel()
    monkeypatch.setattr(index, "sweep", swallow.call)
    task = asyncio.get_running_loop().create_task(index.sweep_forever(interval_s=0.001))
    await asyncio.wait_for(swallow.entered.wait(), 10)
    task.cancel()
    await asyncio.wait({task}, timeout=10)  # a deadline against hangs only
    swallow.release()
    assert task.done(), "the sweep loop went on after it was cancelled"
    await asyncio.wait({task}, timeout=10)
