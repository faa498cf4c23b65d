"""Redis-specific behaviour of RedisIndex and RedisLoadStore, against a real server.

The backend-independent semantics (counting, tiers, lookup walk) are held by the shared
suite ``test_index_behaviour.py``; this file covers what only the Redis backend has:
round trips, key encoding, TTL, slot-id generations, sharing between replicas, and the
shared load view.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis

from scoring.blocks import BlockHasher
from scoring.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    IndexSink,
    encode_batch,
)
from scoring.index import redis_lua
from scoring.index.base import BlockIndex
from scoring.index.redis import RedisIndex, RedisLoadStore
from tests.support.aio import wait_until


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


# -- interface and encoding ---------------------------------------------------------------


def test_redis_index_satisfies_the_block_index_protocol(index: RedisIndex) -> None:
    assert isinstance(index, BlockIndex)


async def test_keys_are_stored_as_8_byte_big_endian_hint_fields(
    index: RedisIndex, raw: aioredis.Redis, redis_namespace: str
) -> None:
    await index.add("pod-a", [0x0102030405060708, 0, (1 << 64) - 1])
    for key in (0x0102030405060708, 0, (1 << 64) - 1):
        assert await hint(raw, redis_namespace, key) is not None
    assert await index.lookup([0x0102030405060708]) == {"pod-a": {"GPU": 1, "CPU": 1, "DISK": 1}}


@pytest.mark.parametrize("bad", [-1, 1 << 64, "12", 1.5])
async def test_a_key_outside_uint64_is_rejected_naming_its_position(
    index: RedisIndex, bad: object
) -> None:
    with pytest.raises(ValueError, match=r"block key #1 must be an unsigned 64-bit int"):
        await index.add("pod-a", [5, bad])  # type: ignore[list-item]
    with pytest.raises(ValueError, match=r"block key #1"):
        await index.lookup([5, bad])  # type: ignore[list-item]


async def test_unknown_tier_empty_pod_and_nul_in_pod_are_rejected(index: RedisIndex) -> None:
    with pytest.raises(ValueError, match="unknown tier 'HBM'"):
        await index.add("pod-a", [1], tier="HBM")
    with pytest.raises(ValueError, match="pod must be a non-empty string"):
        await index.add("", [1])
    with pytest.raises(ValueError, match="pod must not contain NUL"):
        await index.remove("a\0b", [1])


def test_invalid_constructor_parameters_are_named(redis_url: str) -> None:
    with pytest.raises(ValueError, match="namespace must not contain braces"):
        RedisIndex.from_url(redis_url, namespace="a{b}")
    with pytest.raises(ValueError, match="tiers must be distinct"):
        RedisIndex.from_url(redis_url, tiers=("GPU", "GPU"))
    with pytest.raises(ValueError, match="ttl_s must be a non-negative int"):
        RedisIndex.from_url(redis_url, ttl_s=-1)


# -- round trips --------------------------------------------------------------------------


async def test_lookup_of_a_long_chain_is_one_evalsha(
    index: RedisIndex, raw: aioredis.Redis
) -> None:
    chain = list(range(1, 2049))
    for i in range(8):
        await index.add(f"pod-{i}", chain[: 256 * (i + 1)])
    await index.lookup(chain)  # warm: loads the script once if the server lacks it
    assert await round_trips(index.lookup(chain)) == 1
    assert await round_trips(index.lookup(chain, pods=["pod-3", "pod-7"])) == 1
    assert await index.lookup(chain, pods=["pod-3", "pod-7"]) == {
        "pod-3": {"GPU": 1024, "CPU": 1024, "DISK": 1024},
        "pod-7": {"GPU": 2048, "CPU": 2048, "DISK": 2048},
    }


async def test_add_remove_and_clear_are_one_script_call_each(
    index: RedisIndex, raw: aioredis.Redis
) -> None:
    keys = list(range(1000))
    await index.add("pod-a", keys[:1])  # warm the script cache
    await index.remove("pod-a", keys[:1])
    await index.clear_pod("pod-b")
    assert await round_trips(index.add("pod-a", keys)) == 1
    assert await round_trips(index.remove("pod-a", keys)) == 1
    assert await round_trips(index.clear_pod("pod-a")) == 1


async def test_batches_larger_than_batch_keys_go_in_one_pipeline(
    redis_url: str, redis_namespace: str, raw: aioredis.Redis
) -> None:
    idx = RedisIndex.from_url(
        redis_url, namespace=redis_namespace, batch_keys=3, connection_class=CountingConnection
    )
    try:
        await idx.add("pod-z", [1])  # warm the script cache
        assert await round_trips(idx.add("pod-a", list(range(10)))) == 1
        assert await idx.lookup(list(range(10))) == {"pod-a": {"GPU": 10, "CPU": 10, "DISK": 10}}
        assert await idx.pod_entries() == {"pod-a": 10, "pod-z": 1}
        await idx.remove("pod-a", list(range(5, 10)))
        assert await idx.lookup(list(range(10))) == {"pod-a": {"GPU": 5, "CPU": 5, "DISK": 5}}
        await raw.script_flush()  # batches refused with NOSCRIPT are loaded and re-run once
        await idx.add("pod-a", list(range(10)))
        await idx.remove("pod-a", list(range(10)))
        assert await idx.lookup(list(range(10))) == {"pod-a": {"GPU": 5, "CPU": 5, "DISK": 5}}
    finally:
        await idx.close()


async def test_apply_ops_runs_mixed_writes_in_order_in_one_round_trip(
    index: RedisIndex, raw: aioredis.Redis
) -> None:
    warm = [
        ("add", "warm", "GPU", [1]),
        ("remove", "warm", "GPU", [1]),
        ("clear", "warm", None, []),
    ]
    await index.apply_ops(warm)  # the server now has the three scripts
    ops = [
        ("add", "pod-a", "GPU", [1, 2, 3]),
        ("add", "pod-b", "CPU", [1, 2]),
        ("clear", "pod-a", None, []),
        ("add", "pod-a", "GPU", [1]),
        ("remove", "pod-b", "CPU", [2]),
    ]
    assert await round_trips(index.apply_ops(ops)) == 1
    assert await index.lookup([1, 2, 3]) == {
        "pod-a": {"GPU": 1, "CPU": 1, "DISK": 1},
        "pod-b": {"GPU": 0, "CPU": 1, "DISK": 1},
    }
    await raw.script_flush()  # reloaded, and still applied in order
    await index.apply_ops([("clear", "pod-b", "CPU", []), ("add", "pod-b", "GPU", [1, 2])])
    assert (await index.lookup([1, 2]))["pod-b"] == {"GPU": 2, "CPU": 2, "DISK": 2}


async def test_an_event_batch_from_the_sink_reaches_redis_in_one_round_trip(
    index: RedisIndex,
) -> None:
    """The applier path (IndexSink -> IndexOps.apply -> RedisIndex.apply_ops) writes a
    whole decoded batch of mixed events with one round trip, not one per event."""
    tokens = list(range(1000, 1064))  # 4 blocks of 16

    def stored(hashes: list[int], parent: int | None, toks: list[int], medium: str) -> Any:
        return BlockStored(hashes, parent, toks, 16, None, medium)

    sink = IndexSink(index)
    warm = encode_batch(  # loads the add / remove / clear scripts on the server
        [stored([1], None, tokens[:16], "GPU"), BlockRemoved([1], "GPU"), AllBlocksCleared()]
    )
    await sink.apply("warm", "m", sink.decode(warm))
    batch = encode_batch(
        [
            stored([11, 12], None, tokens[:32], "GPU"),
            stored([13, 14], 12, tokens[32:], "GPU"),
            stored([11, 12], None, tokens[:32], "CPU"),  # an offload copy of known blocks
            BlockRemoved([14], "GPU"),
        ]
    )
    assert await round_trips(sink.apply("p", "m", sink.decode(batch))) == 1
    keys = BlockHasher(16, "m").keys(tokens)
    assert await index.lookup(keys) == {"p": {"GPU": 3, "CPU": 3, "DISK": 3}}
    assert await round_trips(sink.clear_pod("p")) == 1
    assert await index.lookup(keys) == {}


async def test_apply_ops_rejects_a_bad_op_before_writing_anything(index: RedisIndex) -> None:
    with pytest.raises(ValueError, match=r"op #1 has unknown kind 'store'"):
        await index.apply_ops([("add", "pod-a", "GPU", [1]), ("store", "pod-a", "GPU", [2])])
    with pytest.raises(ValueError, match=r"op #0 \(add on 'pod-a'\) needs a tier"):
        await index.apply_ops([("add", "pod-a", None, [1])])
    with pytest.raises(ValueError, match="block key #0"):
        await index.apply_ops([("add", "pod-a", "GPU", [1]), ("add", "pod-b", "GPU", [-5])])
    assert await index.lookup([1]) == {}


async def test_scripts_reload_after_the_server_forgets_them(
    index: RedisIndex, raw: aioredis.Redis
) -> None:
    await index.add("pod-a", [1, 2])
    await raw.script_flush()
    assert await index.lookup([1, 2]) == {"pod-a": {"GPU": 2, "CPU": 2, "DISK": 2}}
    await raw.script_flush()
    await index.add("pod-a", [3])
    assert (await index.lookup([1, 2, 3]))["pod-a"]["GPU"] == 3


# -- counting, generations and TTL ------------------------------------------------------


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


class _SwallowsCancel:
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


async def test_the_sweep_loop_ends_when_cancelled_even_if_the_client_swallows_it(
    index: RedisIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    swallow = _SwallowsCancel()
    monkeypatch.setattr(index, "sweep", swallow.call)
    task = asyncio.get_running_loop().create_task(index.sweep_forever(interval_s=0.001))
    await asyncio.wait_for(swallow.entered.wait(), 10)
    task.cancel()
    await asyncio.wait({task}, timeout=10)  # a deadline against hangs only
    swallow.release()
    assert task.done(), "the sweep loop went on after it was cancelled"
    await asyncio.wait({task}, timeout=10)


async def test_the_heartbeat_loop_ends_on_close_even_if_the_client_swallows_the_cancel(
    redis_url: str, redis_namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = RedisLoadStore.from_url(redis_url, namespace=redis_namespace, ttl_s=0.003)
    swallow = _SwallowsCancel()
    monkeypatch.setattr(store, "heartbeat", swallow.call)
    await store.begin("pod-a", 1)  # starts the heartbeat task
    await asyncio.wait_for(swallow.entered.wait(), 10)
    closing = asyncio.ensure_future(store.close())
    await asyncio.wait({closing}, timeout=10)  # a deadline against hangs only
    swallow.release()
    assert closing.done(), "close() waited for a heartbeat loop that lost its cancel"
    await closing


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


# -- several replicas -----------------------------------------------------------------


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
            except (aioredis.ConnectionError, aioredis.ResponseError):
                return False  # still syncing (LOADING / MASTERDOWN)

        await wait_until(caught_up, "the replica to sync")
        assert await replica.lookup([1, 2, 3], pods=["pod-b"]) == {"pod-b": expect["pod-b"]}
        assert await replica.pod_entries() == {"pod-a": 3, "pod-b": 1}
        with pytest.raises(aioredis.ResponseError, match=r"(?i)read.only|readonly"):
            await replica.add("pod-c", [1])
    finally:
        await replica.close()


# -- shared load view -----------------------------------------------------------------


async def test_load_from_several_replicas_is_summed(load_store: LoadStores) -> None:
    r1 = load_store()
    r2 = load_store()
    await r1.begin("pod-a", 1000)
    await r2.begin("pod-a", 500)
    await r2.begin("pod-b", 64)
    await r1.prefill_done("pod-a", 1000)
    assert await r1.snapshot() == {"pod-a": (2, 500), "pod-b": (1, 64)}
    assert await r2.snapshot(["pod-a", "pod-c"]) == {"pod-a": (2, 500), "pod-c": (0, 0)}
    await r2.end("pod-b")
    await r2.prefill_done("pod-b", 64)
    assert await r1.snapshot() == {"pod-a": (2, 500)}


async def test_load_counters_never_go_below_zero(load_store: LoadStores) -> None:
    store = load_store()
    await store.end("pod-a")
    await store.prefill_done("pod-a", 100)
    await store.begin("pod-a", 10)
    assert await store.snapshot() == {"pod-a": (1, 10)}


async def test_a_replica_that_stops_heartbeating_drops_out(
    load_store: LoadStores, redis_namespace: str, raw: aioredis.Redis
) -> None:
    alive = load_store(replica="alive")
    crashed = load_store(replica="crashed")
    await alive.begin("pod-a", 10)
    await crashed.begin("pod-a", 20)
    assert await alive.snapshot() == {"pod-a": (2, 30)}
    # the crashed replica's registration runs out (as if ttl_s passed with no beat)
    zset = b"{" + redis_namespace.encode() + b"}:load:r"
    await raw.zadd(zset, {b"crashed": 0})
    assert await alive.snapshot() == {"pod-a": (1, 10)}
    # its counters also carry a TTL, so nothing outlives it in memory
    h = b"{" + redis_namespace.encode() + b"}:load:h:crashed"
    assert 0 < await raw.pttl(h) <= 15_000


async def test_heartbeat_pushes_the_replica_expiry_forward(
    load_store: LoadStores, redis_namespace: str, raw: aioredis.Redis
) -> None:
    store = load_store(replica="r", ttl_s=60)
    zset = b"{" + redis_namespace.encode() + b"}:load:r"
    await store.begin("pod-a", 1)
    await raw.zadd(zset, {b"r": 1})
    await store.heartbeat()
    assert (await raw.zscore(zset, b"r") or 0) > 1
    assert await store.snapshot() == {"pod-a": (1, 1)}


async def test_the_background_heartbeat_keeps_a_live_replica_registered(
    load_store: LoadStores, redis_namespace: str, raw: aioredis.Redis
) -> None:
    store = load_store(replica="r", ttl_s=0.3)
    zset = b"{" + redis_namespace.encode() + b"}:load:r"
    await store.begin("pod-a", 1)  # starts the heartbeat task (every ttl_s / 3)
    first = await raw.zscore(zset, b"r") or 0

    async def beaten() -> bool:
        return (await raw.zscore(zset, b"r") or 0) > first

    await wait_until(beaten, "a heartbeat to move the expiry")
    assert store.heartbeat_errors == 0
    await store.close()
    assert await raw.zscore(zset, b"r") is None  # close withdrew the replica


async def test_close_withdraws_the_replica_load_at_once(load_store: LoadStores) -> None:
    leaving = load_store()
    staying = load_store()
    await leaving.begin("pod-a", 10)
    await staying.begin("pod-a", 5)
    await leaving.close()
    assert await staying.snapshot() == {"pod-a": (1, 5)}


async def test_clear_pod_forgets_the_pod_load_of_every_replica(load_store: LoadStores) -> None:
    r1 = load_store()
    r2 = load_store()
    await r1.begin("pod-a", 10)
    await r2.begin("pod-a", 10)
    await r2.begin("pod-b", 3)
    await r1.clear_pod("pod-a")
    assert await r2.snapshot() == {"pod-b": (1, 3)}
    await r1.end("pod-a")  # a request finishing after the clear does not go negative
    await r1.begin("pod-a", 7)
    assert await r2.snapshot(["pod-a"]) == {"pod-a": (1, 7)}


async def test_load_store_rejects_bad_deltas(load_store: LoadStores) -> None:
    store = load_store()
    with pytest.raises(ValueError, match="prefill_tokens_delta must be an int"):
        await store.incr("pod-a", 1, 2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="pod must be a non-empty string"):
        await store.incr("", 1, 0)


# -- the walk against a reference model ---------------------------------------------------


def reference_lookup(
    held: dict[tuple[str, str], dict[int, int]],
    tiers: tuple[str, ...],
    keys: list[int],
    pods: list[str] | None,
) -> dict[str, dict[str, int]]:
    """base.py's semantics, spelled out: leading blocks held in a tier <= t, per pod."""
    names = {p for p, _ in held} if pods is None else set(pods)
    out: dict[str, dict[str, int]] = {}
    for pod in names:
        hits = {}
        for ti, tier in enumerate(tiers):
            n = 0
            for k in keys:
                if not any(held.get((pod, t), {}).get(k, 0) > 0 for t in tiers[: ti + 1]):
                    break
                n += 1
            hits[tier] = n
        if hits[tiers[-1]] > 0:
            out[pod] = hits
    return out


class Mirrored:
    """Writes to the index, mirrored in ``held`` for :func:`reference_lookup`."""

    def __init__(self, index: RedisIndex) -> None:
        self.index = index
        self.held: dict[tuple[str, str], dict[int, int]] = {}

    async def add(self, pod: str, keys: list[int], tier: str) -> None:
        await self.index.add(pod, keys, tier)
        d = self.held.setdefault((pod, tier), {})
        for k in keys:
            d[k] = d.get(k, 0) + 1

    async def remove(self, pod: str, keys: list[int], tier: str) -> None:
        await self.index.remove(pod, keys, tier)
        d = self.held.setdefault((pod, tier), {})
        for k in keys:
            if d.get(k, 0) > 0:
                d[k] -= 1

    def expected(self, keys: list[int], pods: list[str] | None = None) -> dict[str, dict[str, int]]:
        return reference_lookup(self.held, self.index.tiers, keys, pods)


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
async def test_lookup_matches_the_reference_model(index: RedisIndex, seed: int) -> None:
    """Many pods share a prefix (runs of equal hints, whole chunks skipped), fewer go on;
    tiers mix, holes appear from removes, copies are counted."""
    import random

    rng = random.Random(seed)
    tiers = index.tiers
    chain = [rng.getrandbits(64) for _ in range(300)]
    pods = [f"pod-{i}" for i in range(20)]
    m = Mirrored(index)
    add, remove = m.add, m.remove

    if seed % 2:  # a run of identical holder sets (a system prompt on every pod)
        for pod in pods:
            await add(pod, chain[:24], "GPU")
        for pod in rng.sample(pods, 3):
            await add(pod, chain[: rng.randrange(5, 30)], "CPU")
    for pod in pods:
        await add(pod, chain[: rng.randrange(1, 40)], "GPU")
    for pod in rng.sample(pods, 6):
        await add(pod, chain[: rng.randrange(40, 300)], rng.choice(tiers))
    for pod in rng.sample(pods, 5):
        await add(pod, chain[rng.randrange(0, 60) : rng.randrange(60, 250)], "CPU")
    for pod in rng.sample(pods, 4):  # duplicate copies: one remove leaves one
        await add(pod, chain[:30], "GPU")
    for _ in range(25):
        pod, tier = rng.choice(pods), rng.choice(tiers)
        i = rng.randrange(0, 250)
        await remove(pod, chain[i : i + rng.randrange(1, 4)], tier)
    for query in (chain, chain[:50], chain[:1]):
        assert await index.lookup(query) == m.expected(query)
        cands = [*rng.sample(pods, 7), "pod-unknown"]  # fewer candidates than holders
        assert await index.lookup(query, cands) == m.expected(query, cands)
        many = [*rng.sample(pods, 15), *(f"ghost-{i}" for i in range(40))]  # more
        assert await index.lookup(query, many) == m.expected(query, many)
    await index.clear_pod(pods[0])
    for tier in tiers:
        m.held.pop((pods[0], tier), None)
    assert await index.lookup(chain) == m.expected(chain)


@pytest.mark.parametrize("hole", [0, 15, 16, 47, 48, 499, 1000, 1999])
async def test_long_runs_of_equal_hints_are_passed_by_chunk_yet_every_hole_is_found(
    index: RedisIndex, hole: int
) -> None:
    """A 2,000-block chain whose holder sets stay equal for hundreds of blocks (the walk
    passes whole chunks with one comparison); a single missing block anywhere -- first
    block of a chunk, last, middle -- still ends that pod's run, per tier."""
    chain = list(range(10_000, 12_000))
    m = Mirrored(index)
    await m.add("gpu-all", chain, "GPU")
    await m.add("holed", chain, "GPU")
    await m.add("two-tiers", chain[:1500], "GPU")  # one pod, two slots
    await m.add("two-tiers", chain, "CPU")
    await m.add("cpu-only", chain, "CPU")
    await m.remove("holed", [chain[hole]], "GPU")
    await m.remove("two-tiers", [chain[hole]], "CPU")  # the GPU copy still covers it
    expected = m.expected(chain)
    assert expected.get("holed", {}).get("GPU", 0) == hole
    assert expected["two-tiers"] == {
        "GPU": 1500,
        "CPU": 2000 if hole < 1500 else hole,
        "DISK": 2000 if hole < 1500 else hole,
    }
    assert await index.lookup(chain) == expected
    assert await index.lookup(chain, ["holed", "two-tiers"]) == {
        p: expected[p] for p in ("holed", "two-tiers") if p in expected
    }


@pytest.mark.parametrize("candidates", [None, ["pod-a"], ["pod-a", "pod-b", "pod-c", "pod-d"]])
async def test_a_slower_tier_lacking_block_0_still_extends_that_tiers_run(
    index: RedisIndex, candidates: list[str] | None
) -> None:
    """Block 0 only in GPU, blocks 1-9 only in CPU: the CPU (and DISK) run is 10 blocks,
    the GPU run 1 -- the CPU slot is found although block 0's hint does not name it.
    A pod whose run ended is not revived by a slot of it met further on."""
    chain = list(range(100, 110))
    await index.add("pod-a", chain[:1], "GPU")
    await index.add("pod-a", chain[1:], "CPU")
    await index.add("pod-b", chain[:2], "GPU")
    await index.add("pod-b", chain[3:], "CPU")  # block 2 held nowhere: run ends at 2
    hits = await index.lookup(chain, candidates)
    assert hits["pod-a"] == {"GPU": 1, "CPU": 10, "DISK": 10}
    if candidates is None or "pod-b" in candidates:
        assert hits["pod-b"] == {"GPU": 2, "CPU": 2, "DISK": 2}
    assert set(hits) <= {"pod-a", "pod-b"}
