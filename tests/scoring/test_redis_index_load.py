"""RedisLoadStore: the shared load view of several router replicas, their heartbeats and
expiry (real server).
"""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from scoring.index.redis import RedisLoadStore
from tests.scoring.redis_index_support import LoadStores, SwallowsCancel
from tests.scoring.redis_index_support import load_store as load_store  # the fixture
from tests.scoring.redis_index_support import raw as raw  # the fixture
from tests.support.aio import wait_until


async def test_the_heartbeat_loop_ends_on_close_even_if_the_client_swallows_the_cancel(
    redis_url: str, redis_namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = RedisLoadStore.from_url(redis_url, namespace=redis_namespace, ttl_s=0.003)
    swallow = SwallowsCancel()
    monkeypatch.setattr(store, "heartbeat", swallow.call)
    await store.begin("pod-a", 1)  # starts the heartbeat task
    await asyncio.wait_for(swallow.entered.wait(), 10)
    closing = asyncio.ensure_future(store.close())
    await asyncio.wait({closing}, timeout=10)  # a deadline against hangs only
    swallow.release()
    assert closing.done(), "close() waited for a heartbeat loop that lost its cancel"
    await closing


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
