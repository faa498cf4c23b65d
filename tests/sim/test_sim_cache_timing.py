"""When the simulated engine's cache changes, and that the router's index follows it.

vLLM V1 caches the blocks of a prefill when it schedules them, before the step computes
them (``KVCacheManager.allocate_slots`` -> ``cache_blocks``), and evicts for them then:
their ``BlockStored`` and ``BlockRemoved`` go out at the prefill's start.  The simulated
engine does the same, so that the router's index never shows blocks a running prefill
has already pushed out (the replay's pod inserts at the prefill's start too).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time

import msgspec

from router.sim.engine import SimEngine, SimRequest
from router.sim.events import EventBatch, KVCacheEvent
from router.sim.settings import SimSettings
from scoring.blocks import BlockHasher
from scoring.events import KVEventApplier
from scoring.index.memory import InMemoryIndex

BS = 16


def _engine(capacity_blocks: int, **kw: object) -> SimEngine:
    return SimEngine(
        SimSettings(capacity_tokens=BS * capacity_blocks, block_size=BS, model="m", **kw)
    )


async def _run(engine: SimEngine, prompt: list[int], max_tokens: int = 1) -> list[int]:
    req = engine.prepare(SimRequest(prompt_ids=prompt, max_tokens=max_tokens))
    async with contextlib.aclosing(engine.generate(req)) as tokens:
        return [t async for t in tokens]


async def test_a_prefill_publishes_its_blocks_and_their_evictions_when_it_starts() -> None:
    published: list[list[str]] = []
    at_prefill: list[list[list[str]]] = []

    async def sleep(seconds: float) -> None:
        at_prefill.append(list(published))  # what had gone out when the prefill began

    engine = SimEngine(
        SimSettings(capacity_tokens=BS * 4, block_size=BS, model="m", prefill_rate=1000.0),
        sleep=sleep,
    )
    engine.sink = lambda events: published.append([type(e).__name__ for e in events])
    await _run(engine, list(range(100, 100 + 3 * BS + 1)))  # 3 blocks
    assert at_prefill[0] == [["BlockStored"]]
    published.clear()
    at_prefill.clear()
    await _run(engine, list(range(500, 500 + 3 * BS + 1)))  # 3 more: 2 of the first go
    assert at_prefill[0] == [["BlockRemoved", "BlockRemoved", "BlockStored"]]


async def test_the_router_index_mirrors_the_engine_cache_through_evictions() -> None:
    engine = _engine(120, time_scale=0.0, max_batch=4)
    encode = msgspec.msgpack.Encoder().encode
    applier = KVEventApplier()
    applier.set_pod("p", "m", BS)
    index = InMemoryIndex()

    def sink(events: list[KVCacheEvent]) -> None:
        applier.ingest_sync(index, "p", encode(EventBatch(ts=time.time(), events=events)))

    engine.sink = sink
    keys_of = BlockHasher(BS, "m").keys
    rng = random.Random(7)
    systems = [[rng.randrange(100, 4000) for _ in range(BS * 6 + 5)] for _ in range(3)]
    chats = [list(rng.choice(systems)) for _ in range(10)]
    mismatches: list[tuple[int, int]] = []

    async def turn(chat: list[int]) -> None:
        chat += [rng.randrange(100, 4000) for _ in range(rng.randrange(20, 70))]
        await _run(engine, list(chat), max_tokens=rng.randrange(1, 30))
        chat += [rng.randrange(100, 4000) for _ in range(24)]  # the scripted answer
        for other in chats:
            hits = index.lookup_sync(keys_of(other)).get("p")
            shown = max(hits.values()) if hits else 0
            true = engine.cache.match(engine.prepare(SimRequest(other, 1)).block_hashes)
            if shown != true:
                mismatches.append((shown, true))

    for _ in range(60):
        await asyncio.gather(*(turn(rng.choice(chats)) for _ in range(3)))
    assert len(engine.cache) == 120  # the cache filled and evicted
    assert mismatches == []
