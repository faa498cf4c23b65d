"""Applying KV events: copies counted per block and tier, removals, offload tiers,
AllBlocksCleared, and the bound on blocks per pod.
"""

from __future__ import annotations

from scoring.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
)
from tests.scoring.events_support import BS, MODEL, TOKENS, feed, gpu, keys_of, setup, stored


def test_the_same_hash_stored_twice_needs_two_removals() -> None:
    applier, index = setup()
    feed(applier, index, stored([11, 12], None, TOKENS[:32]))
    feed(applier, index, stored([11, 12], None, TOKENS[:32]))
    feed(applier, index, BlockRemoved([12], "GPU"))
    assert index.lookup_sync(keys_of(TOKENS)) == {"p": gpu(2, index)}
    feed(applier, index, BlockRemoved([12], "GPU"))
    assert index.lookup_sync(keys_of(TOKENS)) == {"p": gpu(1, index)}
    assert applier.stats.removed_blocks == 2


def test_copies_are_counted_per_tier_and_per_block() -> None:
    applier, index = setup()
    feed(applier, index, stored([11], None, TOKENS[:16]))
    st = applier.pod("p")
    assert st is not None and st.copies(11) == {"GPU": 1}
    feed(applier, index, stored([11], None, TOKENS[:16]))
    feed(applier, index, stored([11], None, TOKENS[:16], medium="CPU"))
    assert st.copies(11) == {"GPU": 2, "CPU": 1}
    feed(applier, index, BlockRemoved([11], "CPU"), BlockRemoved([11], "GPU"))
    assert st.copies(11) == {"GPU": 1}
    assert st.key_of(11) == keys_of(TOKENS)[0]
    feed(applier, index, BlockRemoved([11], "GPU"))
    assert st.copies(11) == {} and st.key_of(11) is None


def test_gpu_blocks_counts_the_distinct_blocks_the_gpu_tier_holds() -> None:
    """What the router compares with the engine's num_gpu_blocks: one per block held in
    the GPU tier, however many copies; offload tiers do not count."""
    applier, index = setup()
    st = applier.pod("p")
    assert st is not None
    feed(applier, index, stored([11, 12], None, TOKENS[:32]))
    feed(applier, index, stored([11, 12], None, TOKENS[:32]))  # second copies
    feed(applier, index, stored([11, 12, 13], None, TOKENS[:48], medium="CPU"))
    assert st.gpu_blocks == 2
    feed(applier, index, BlockRemoved([12], "GPU"))  # one of two copies
    assert st.gpu_blocks == 2
    feed(applier, index, BlockRemoved([12], "GPU"), BlockRemoved([11], "CPU"))
    assert st.gpu_blocks == 1
    feed(applier, index, BlockRemoved([999], "GPU"))  # never seen: no change
    assert st.gpu_blocks == 1
    feed(applier, index, AllBlocksCleared())
    assert st.gpu_blocks == 0
    small, idx = setup(max_blocks_per_pod=100)
    feed(small, idx, BlockStored(list(range(1, 151)), None, list(range(16 * 150)), BS, None, "GPU"))
    held = small.pod("p")
    assert held is not None and held.gpu_blocks == len(held.blocks) <= 100  # evictions too


def test_removing_the_tail_shrinks_the_chain_from_the_end() -> None:
    applier, index = setup()
    feed(applier, index, stored([11, 12, 13, 14], None, TOKENS))
    feed(applier, index, BlockRemoved([14], "GPU"), BlockRemoved([13], "GPU"))
    assert index.lookup_sync(keys_of(TOKENS)) == {"p": gpu(2, index)}
    st = applier.pod("p")
    assert st is not None and set(st.blocks) == {11, 12}  # forgotten with the blocks


def test_removing_a_block_we_never_saw_is_counted_and_ignored() -> None:
    applier, index = setup()
    feed(applier, index, stored([11], None, TOKENS[:16]))
    feed(applier, index, BlockRemoved([999], "GPU"), BlockRemoved([11], "CPU"))
    assert applier.stats.unknown_removed == 2
    assert index.lookup_sync(keys_of(TOKENS)) == {"p": gpu(1, index)}


def test_a_cpu_medium_records_an_offload_tier_copy() -> None:
    applier, index = setup()
    feed(applier, index, stored([11, 12, 13, 14], None, TOKENS))
    feed(applier, index, stored([11, 12, 13, 14], None, TOKENS, medium="CPU"))
    feed(applier, index, BlockRemoved([13], "GPU"), BlockRemoved([14], "GPU"))
    assert index.lookup_sync(keys_of(TOKENS)) == {"p": {"GPU": 2, "CPU": 4, "DISK": 4}}
    feed(applier, index, BlockRemoved([14], "CPU"))
    assert index.lookup_sync(keys_of(TOKENS)) == {"p": {"GPU": 2, "CPU": 3, "DISK": 3}}


def test_an_offload_placeholder_without_tokens_records_known_blocks_only() -> None:
    applier, index = setup()
    feed(applier, index, stored([11, 12], None, TOKENS[:32]))
    feed(applier, index, BlockStored([12, 77], None, [], 0, None, "CPU"))
    feed(applier, index, BlockRemoved([12], "GPU"))
    assert index.lookup_sync(keys_of(TOKENS)) == {"p": {"GPU": 1, "CPU": 2, "DISK": 2}}
    assert applier.stats.unresolved_blocks == 1


def test_storage_medium_maps_to_the_disk_tier() -> None:
    applier, index = setup()
    feed(applier, index, stored([11], None, TOKENS[:16], medium="STORAGE"))
    assert index.lookup_sync(keys_of(TOKENS)) == {"p": {"GPU": 0, "CPU": 0, "DISK": 1}}


def test_all_blocks_cleared_forgets_the_pod_in_every_tier() -> None:
    applier, index = setup()
    applier.set_pod("q", MODEL)
    feed(applier, index, stored([11, 12], None, TOKENS[:32]))
    feed(applier, index, stored([11], None, TOKENS[:16], medium="CPU"))
    feed(applier, index, stored([11], None, TOKENS[:16]), pod="q")
    feed(applier, index, AllBlocksCleared())
    assert index.lookup_sync(keys_of(TOKENS)) == {"q": gpu(1, index)}
    assert applier.stats.cleared == 1
    st = applier.pod("p")
    assert st is not None and st.blocks == {}


def test_a_pod_keeps_at_most_max_blocks_per_pod_hashes() -> None:
    applier, index = setup(max_blocks_per_pod=100)
    tokens = list(range(16 * 150))
    feed(applier, index, BlockStored(list(range(1, 151)), None, tokens, BS, None, "GPU"))
    st = applier.pod("p")
    assert st is not None and len(st.blocks) <= 100
    assert applier.stats.evicted_blocks >= 50
    assert index.lookup_sync(keys_of(tokens)) == {}  # the chain's head was forgotten
