"""RedisIndex's writes and lookups in one round trip each, and script reloading (real
server).
"""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as aioredis

from scoring.blocks import BlockHasher
from scoring.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    IndexSink,
    encode_batch,
)
from scoring.index.redis import RedisIndex
from tests.scoring.redis_index_support import CountingConnection, round_trips
from tests.scoring.redis_index_support import index as index  # the fixture
from tests.scoring.redis_index_support import raw as raw  # the fixture


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

    def stored(hashes: list[EngineHash], parent: int | None, toks: list[int], medium: str) -> Any:
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
