"""Orphaned BlockStored events (llm-d #372): counted, flagged for resync, linked when the
parent arrives, bounded, dropped by AllBlocksCleared.
"""

from __future__ import annotations

from scoring.events import (
    AllBlocksCleared,
    BlockRemoved,
)
from tests.scoring.events_support import TOKENS, feed, gpu, keys_of, setup, stored


def test_a_block_stored_with_an_unknown_parent_is_counted_and_flags_resync() -> None:
    applier, index = setup()
    feed(applier, index, stored([13, 14], 12, TOKENS[32:]))
    assert applier.stats.orphaned_blocks == 2
    st = applier.pod("p")
    assert st is not None and st.needs_resync and st.orphan_blocks == 2
    assert index.lookup_sync(keys_of(TOKENS)) == {}


def test_an_orphan_is_linked_when_its_parent_arrives_later() -> None:
    applier, index = setup()
    feed(applier, index, stored([13, 14], 12, TOKENS[32:]))  # before its parent (replay)
    feed(applier, index, stored([11, 12], None, TOKENS[:32]))
    assert index.lookup_sync(keys_of(TOKENS)) == {"p": gpu(4, index)}
    assert applier.stats.orphans_linked == 2
    st = applier.pod("p")
    assert st is not None and not st.needs_resync


def test_a_block_removed_while_its_orphan_waits_is_not_indexed_when_linked() -> None:
    applier, index = setup()
    feed(applier, index, stored([13, 14], 12, TOKENS[32:]))  # orphan
    feed(applier, index, BlockRemoved([14], "GPU"))  # the engine evicts its tail
    assert applier.stats.unknown_removed == 0
    feed(applier, index, stored([11, 12], None, TOKENS[:32]))  # the parent, via replay
    assert index.lookup_sync(keys_of(TOKENS)) == {"p": gpu(3, index)}
    st = applier.pod("p")
    assert st is not None and set(st.blocks) == {11, 12, 13} and st.orphan_removed == {}


def test_orphans_link_transitively() -> None:
    applier, index = setup()
    feed(applier, index, stored([14], 13, TOKENS[48:]))
    feed(applier, index, stored([13], 12, TOKENS[32:48]))
    feed(applier, index, stored([11, 12], None, TOKENS[:32]))
    assert index.lookup_sync(keys_of(TOKENS)) == {"p": gpu(4, index)}
    assert applier.stats.orphans_linked == 2


def test_the_orphan_buffer_is_bounded_and_dropping_keeps_the_resync_flag() -> None:
    applier, index = setup(max_orphan_blocks=3)
    feed(applier, index, stored([21, 22], 20, TOKENS[:32]), stored([31, 32], 30, TOKENS[32:]))
    assert applier.stats.orphans_dropped == 2  # the oldest orphan made room
    feed(applier, index, stored([20], None, TOKENS[:16]))  # its parent comes too late
    assert applier.stats.orphans_linked == 0
    st = applier.pod("p")
    assert st is not None and st.needs_resync and st.orphan_blocks == 2
    ops = applier.clear_pod("p")
    ops.apply_sync(index)
    assert not st.needs_resync and index.lookup_sync(keys_of(TOKENS)) == {}


def test_mark_resynced_clears_the_lost_events_flag() -> None:
    applier, index = setup()
    applier.ingest_sync(index, "p", b"junk")
    assert applier.pods_needing_resync() == ["p"]
    applier.mark_resynced("p")
    assert applier.pods_needing_resync() == []


def test_all_blocks_cleared_drops_pending_orphans() -> None:
    applier, index = setup()
    feed(applier, index, stored([13], 12, TOKENS[32:48]))
    feed(applier, index, AllBlocksCleared())
    st = applier.pod("p")
    assert st is not None and st.orphans == {} and not st.needs_resync
