"""Applying KV events: the router's own block keys from the events' token ids (parents,
model, cache_salt, LoRA, multimodal extra keys) and the block size used.
"""

from __future__ import annotations

from scoring.blocks import BlockHasher
from scoring.events import (
    BlockStored,
)
from tests.scoring.events_support import BS, MODEL, TOKENS, feed, gpu, keys_of, setup, stored


def test_a_chain_from_token_zero_is_indexed_under_the_routers_own_keys() -> None:
    applier, index = setup()
    feed(applier, index, stored([11, 12, 13, 14], None, TOKENS))
    assert index.lookup_sync(keys_of(TOKENS)) == {"p": gpu(4, index)}
    assert applier.stats.stored_blocks == 4


def test_a_chain_continues_from_its_parents_key() -> None:
    applier, index = setup()
    feed(applier, index, stored([11, 12], None, TOKENS[:32]))
    feed(applier, index, stored([13, 14], 12, TOKENS[32:]))
    assert index.lookup_sync(keys_of(TOKENS)) == {"p": gpu(4, index)}


def test_the_model_of_the_pod_is_part_of_the_key() -> None:
    applier, index = setup()
    applier.set_pod("q", "other-model")
    feed(applier, index, stored([11, 12, 13, 14], None, TOKENS), pod="q")
    assert index.lookup_sync(keys_of(TOKENS)) == {}
    assert index.lookup_sync(BlockHasher(BS, "other-model").keys(TOKENS)) == {"q": gpu(4, index)}


def test_cache_salt_comes_from_block_zeros_extra_keys() -> None:
    applier, index = setup()
    feed(applier, index, stored([11, 12], None, TOKENS[:32], extra_keys=[["salty"], None]))
    assert index.lookup_sync(keys_of(TOKENS[:32], salt="salty")) == {"p": gpu(2, index)}
    assert index.lookup_sync(keys_of(TOKENS[:32])) == {}


def test_lora_name_seeds_every_block_and_salt_follows_it_in_extra_keys() -> None:
    applier, index = setup()
    ev = stored([11, 12], None, TOKENS[:32], lora_name="ad", extra_keys=[["ad", "salty"], ["ad"]])
    feed(applier, index, ev)
    assert index.lookup_sync(keys_of(TOKENS[:32], lora="ad", salt="salty")) == {"p": gpu(2, index)}
    assert index.lookup_sync(keys_of(TOKENS[:32], lora="ad")) == {}


def test_multimodal_pairs_before_the_salt_are_skipped() -> None:
    applier, index = setup()
    feed(applier, index, stored([11], None, TOKENS[:16], extra_keys=[[["img-1", 3], "salty"]]))
    assert index.lookup_sync(keys_of(TOKENS[:16], salt="salty")) == {"p": gpu(1, index)}


def test_the_block_size_comes_from_the_event_and_is_learned_for_the_pod() -> None:
    applier, index = setup()
    ev = BlockStored([11, 12], None, TOKENS, 32, None, "GPU")
    feed(applier, index, ev)
    st = applier.pod("p")
    assert st is not None and st.block_size == 32
    assert index.lookup_sync(BlockHasher(32, MODEL).keys(TOKENS)) == {"p": gpu(2, index)}
    feed(applier, index, stored([13], 12, TOKENS[:16]))  # a 16-token block now
    assert applier.stats.block_size_mismatches == 1


def test_the_configured_block_size_is_used_when_the_event_has_none() -> None:
    applier, index = setup(block_size=BS)
    feed(applier, index, BlockStored([11, 12], None, TOKENS[:32], 0, None, "GPU"))
    assert index.lookup_sync(keys_of(TOKENS[:32])) == {"p": gpu(2, index)}
