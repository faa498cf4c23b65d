"""Applying KV events from bad input: unregistered pods, undecodable payloads, wrong token
counts, unknown media, odd extra keys, events that fail to apply.
"""

from __future__ import annotations

import pytest

from scoring.events import (
    AllBlocksCleared,
    BlockStored,
    EngineHasher,
    EventBatch,
    KVEventApplier,
    UnknownPodError,
    encode_batch,
    encode_batch_positional,
)
from tests.scoring.events_support import BS, TOKENS, enc, feed, gpu, keys_of, setup, stored


def test_events_for_an_unregistered_pod_are_refused_by_name() -> None:
    applier = KVEventApplier()
    with pytest.raises(UnknownPodError, match="'ghost'"):
        applier.ingest("ghost", encode_batch([AllBlocksCleared()]))


def test_an_undecodable_payload_is_counted_and_flags_the_pod() -> None:
    applier, index = setup()
    applier.ingest_sync(index, "p", b"\xc1garbage")
    assert applier.stats.decode_errors == 1
    assert "not valid msgpack" in applier.stats.last_error
    assert applier.pods_needing_resync() == ["p"]


def test_a_block_stored_with_the_wrong_token_count_is_skipped_as_bad() -> None:
    applier, index = setup()
    feed(applier, index, stored([11, 12], None, TOKENS[:20]), stored([13], None, TOKENS[:16]))
    assert applier.stats.bad_events == 1
    assert "2 hashes and 20 tokens" in applier.stats.last_error
    assert applier.stats.stored_blocks == 1  # the next event still applied


def test_an_unknown_medium_is_skipped_as_bad() -> None:
    applier, index = setup()
    feed(applier, index, stored([11], None, TOKENS[:16], medium="TAPE"))
    assert applier.stats.bad_events == 1 and "'TAPE'" in applier.stats.last_error
    assert index.lookup_sync(keys_of(TOKENS)) == {}


def test_unknown_and_malformed_events_in_a_batch_are_counted() -> None:
    applier, index = setup()
    applier.ingest_sync(
        index,
        "p",
        enc([0, [{"type": "Future"}, {"type": "BlockRemoved"}, {"type": "AllBlocksCleared"}]]),
    )
    assert applier.stats.unknown_events == 1
    assert applier.stats.bad_events == 1
    assert applier.stats.cleared == 1


def test_out_of_range_token_ids_are_a_bad_event_not_a_crash() -> None:
    applier, index = setup()
    feed(applier, index, stored([11], None, [-1] * 16))
    assert applier.stats.bad_events == 1


def test_odd_extra_keys_shapes_do_not_break_ingest() -> None:
    ours = EngineHasher("sha256", "42")
    applier, index = setup(engine_hasher=ours)
    feed(
        applier,
        index,
        stored([11], None, TOKENS[:16], extra_keys=[5]),
        stored([21], None, TOKENS[16:32], extra_keys=[{"salt": "x"}]),
        stored([31], None, TOKENS[32:48], extra_keys=[["salt", 3.5]]),
    )
    assert applier.stats.stored_blocks == 3 and applier.stats.bad_events == 0
    assert index.lookup_sync(keys_of(TOKENS[:16])) == {"p": gpu(1, index)}
    assert ours.unverifiable == 3 and ours.mismatches == 0 and ours.enabled


def test_older_engines_positional_events_apply_like_map_events() -> None:
    applier, index = setup()
    payload = encode_batch_positional(
        [stored([11, 12], None, TOKENS[:32]), stored([13, 14], 12, TOKENS[32:])]
    )
    applier.ingest_sync(index, "p", payload)
    applier.ingest_sync(index, "p", enc([0.0, [["BlockRemoved", [14], "GPU"]]]))
    assert index.lookup_sync(keys_of(TOKENS)) == {"p": gpu(3, index)}


def test_an_event_that_fails_to_apply_is_counted_and_the_batch_goes_on() -> None:
    applier, index = setup()
    weird = BlockStored([[1, 2]], None, TOKENS[:16], BS, None, "GPU")  # type: ignore[list-item]
    ok = stored([11], None, TOKENS[:16])
    applier.apply_batch("p", EventBatch(0.0, [weird, ok])).apply_sync(index)
    assert applier.stats.bad_events == 1 and "could not be applied" in applier.stats.last_error
    assert index.lookup_sync(keys_of(TOKENS)) == {"p": gpu(1, index)}
