"""RedisIndex's interface and key encoding, and the arguments it rejects (real server).

The backend-independent semantics (counting, tiers, lookup walk) are held by the shared
suite ``test_index_behaviour.py``; the ``test_redis_index_*.py`` files cover what only the
Redis backend has.
"""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from scoring.index.base import BlockIndex
from scoring.index.redis import RedisIndex
from tests.scoring.redis_index_support import hint
from tests.scoring.redis_index_support import index as index  # the fixture
from tests.scoring.redis_index_support import raw as raw  # the fixture


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
