"""Applying KV events through the async index protocol: IndexOps on any backend, IndexSink,
and consecutive writes merged into one index call.
"""

from __future__ import annotations

import pytest

from scoring.events import (
    BlockRemoved,
    IndexSink,
    KVEventApplier,
    encode_batch,
)
from scoring.index.base import BlockIndex
from scoring.index.memory import InMemoryIndex
from tests.scoring.events_support import MODEL, TOKENS, gpu, keys_of, setup, stored


async def test_index_ops_apply_to_any_backend(index: BlockIndex) -> None:
    applier = KVEventApplier()
    applier.set_pod("p", MODEL)
    await applier.ingest("p", encode_batch([stored([11, 12, 13, 14], None, TOKENS)])).apply(index)
    await applier.ingest("p", encode_batch([BlockRemoved([14], "GPU")])).apply(index)
    assert await index.lookup(keys_of(TOKENS)) == {"p": dict.fromkeys(index.tiers, 3)}
    await applier.clear_pod("p").apply(index)
    assert await index.lookup(keys_of(TOKENS)) == {}


async def test_index_sink_decodes_registers_the_pod_and_applies() -> None:
    index = InMemoryIndex()
    sink = IndexSink(index)
    n = await sink.apply(
        "p", MODEL, sink.decode(encode_batch([stored([11, 12], None, TOKENS[:32])]))
    )
    assert n == 1
    assert index.lookup_sync(keys_of(TOKENS)) == {"p": gpu(2, index)}
    with pytest.raises(ValueError):
        sink.decode(b"junk")
    assert sink.stats.decode_errors == 1
    await sink.clear_pod("p")
    assert index.lookup_sync(keys_of(TOKENS)) == {}
    assert not sink.needs_resync("p")
    await sink.apply("p", MODEL, sink.decode(encode_batch([stored([13], 12, TOKENS[:16])])))
    assert sink.needs_resync("p")  # an orphan waits
    await sink.remove_pod("p")
    assert sink.applier.pod("p") is None and not sink.needs_resync("p")


def test_consecutive_writes_are_merged_into_one_index_call() -> None:
    applier, _ = setup()
    ops = applier.ingest(
        "p", encode_batch([stored([11, 12], None, TOKENS[:32]), stored([13, 14], 12, TOKENS[32:])])
    )
    assert [(k, p, t, len(keys)) for k, p, t, keys in ops.ops] == [("add", "p", "GPU", 4)]
