"""Decoding vLLM's KV-event wire format: the map encoding, the positional one of older
engines, unknown fields and event types, malformed events and payloads.
"""

from __future__ import annotations

import msgspec
import pytest

from scoring.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    decode_batch,
    encode_batch,
    encode_batch_positional,
)
from tests.scoring.events_support import TOKENS, enc, stored


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
