"""A pod's KV events are interpreted with that pod's block size: its
``vllm:cache_config_info`` when scraped, else the size its events name — never a
default taken for a fact.  Real vLLM 0.32 events at block size 32
(tests/fixtures/vllm_events/), applied through the router's own sink as its event
writer applies them, with the README's real-pod config (no ``block_size`` set)."""

from __future__ import annotations

from typing import Any

import msgspec

from router.config import Settings
from router.events.sink import IndexSink, make_sink
from router.fleet.scrape import Scraped
from scoring.blocks import BlockHasher
from scoring.events import BlockStored
from scoring.index.memory import InMemoryIndex
from tests.scoring.test_real_vllm_payloads import SCENARIOS, pub_messages, request

SCENARIO = "sha256_int"
POD = "vllm-0"
MODEL = SCENARIOS[SCENARIO]["served_model_name"]
REAL_BLOCK_SIZE = SCENARIOS[SCENARIO]["block_size"]


def _sink(**settings: Any) -> tuple[IndexSink, InMemoryIndex]:
    index = InMemoryIndex()
    return make_sink(
        index, Settings.model_validate({"fleet": {"enabled": False}, **settings})
    ), index


async def _apply_all(
    sink: IndexSink, facts: Scraped | None, upto: int | None = None, *, unsized: bool = False
) -> int:
    """Apply the captured batches (through seq ``upto``; ``unsized``: with the events'
    ``block_size`` taken out, as an engine that omits it); the BlockStored count."""
    stored = 0
    for m in pub_messages(SCENARIO):
        if upto is not None and m.seq > upto:
            break
        batch = sink.decode(m.payload)
        if unsized:
            batch.events = [
                msgspec.structs.replace(e, block_size=0) if isinstance(e, BlockStored) else e
                for e in batch.events
            ]
        stored += sum(len(getattr(e, "token_ids", ()) or ()) > 0 for e in batch.events)
        await sink.apply_checked(POD, MODEL, batch, facts)
    return stored


def _prompt_keys() -> list[int]:
    tokens = request(SCENARIO, "completion_a")["token_ids"]
    return BlockHasher(block_size=REAL_BLOCK_SIZE, model=MODEL).keys(tokens)


async def test_events_before_the_first_scrape_teach_the_pods_block_size() -> None:
    assert REAL_BLOCK_SIZE == 32  # not the events fallback (16)
    sink, index = _sink()  # the README's real-pod config: no block_size
    # the scraper has not answered yet; up to the first request's blocks
    stored = await _apply_all(sink, None, max(request(SCENARIO, "completion_a")["seqs_after"]))
    assert stored > 0
    assert sink.stats.block_size_mismatches == 0
    pod = sink.applier.pod(POD)
    assert pod is not None and pod.block_size == 32
    keys = _prompt_keys()
    assert (await index.lookup(keys))[POD]["GPU"] == len(keys)


async def test_the_scraped_cache_config_interprets_events_that_omit_the_size() -> None:
    upto = max(request(SCENARIO, "completion_a")["seqs_after"])
    # without the pod's size, events without one are read at the fallback (16): refused
    blind, _ = _sink()
    await _apply_all(blind, None, upto, unsized=True)
    assert blind.stats.bad_events > 0 and blind.stats.stored_blocks == 0
    # with the scraped vllm:cache_config_info (block_size 32) they are read right
    sink, index = _sink()
    facts = Scraped(at=0.0, block_size=32, capacity_blocks=96)
    await _apply_all(sink, facts, upto, unsized=True)
    assert sink.stats.block_size_mismatches == 0 and sink.stats.bad_events == 0
    keys = _prompt_keys()
    assert (await index.lookup(keys))[POD]["GPU"] == len(keys)


async def test_a_configured_block_size_the_events_contradict_is_a_mismatch() -> None:
    sink, _ = _sink(block_size=16)  # wrong: requests would be hashed at 16, hits 0
    stored = await _apply_all(sink, facts=None)
    assert sink.stats.block_size_mismatches == stored
