"""The ``index`` fixture: every BlockIndex backend, for the shared behaviour suite.

``memory`` is :class:`scoring.index.memory.InMemoryIndex`; ``redis`` is
:class:`scoring.index.redis.RedisIndex` on the real server of the project-wide
``redis_url`` fixture (tests/conftest.py), in a namespace of its own.  The redis
param skips, saying why, when that backend or fixture is not available.
"""

from __future__ import annotations

import importlib
import uuid
from collections.abc import AsyncIterator

import pytest

from scoring.index.base import BlockIndex
from scoring.index.memory import InMemoryIndex


@pytest.fixture(params=["memory", "redis"])
async def index(request: pytest.FixtureRequest) -> AsyncIterator[BlockIndex]:
    if request.param == "memory":
        mem = InMemoryIndex(max_entries=1_000_000)
        yield mem
        await mem.close()
        return
    try:
        mod = importlib.import_module("scoring.index.redis")
    except ImportError as exc:
        pytest.skip(f"scoring.index.redis cannot be imported: {exc}")
    try:
        url = request.getfixturevalue("redis_url")
    except pytest.FixtureLookupError:
        pytest.skip("no redis_url fixture (tests/conftest.py) to reach a real server")
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url, decode_responses=False)
    idx = mod.RedisIndex(client, namespace=f"behaviour-{uuid.uuid4().hex[:12]}", owns_client=True)
    try:
        yield idx
    finally:
        await idx.close()
