"""What a real vLLM 0.32 CPU engine puts on the wire, from captured frames.

The fixtures in ``tests/fixtures/vllm_events/`` were produced by
``python tools/capture_vllm_events.py`` against real engines (see its manifest: engine
version, hash algorithm, int or bytes hashes, PYTHONHASHSEED, every request sent with the
``/tokenize`` ids of its prompt).  These tests need no engine: they pin down the wire
format the router decodes, and check that the project's decoder and index understand it.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import xxhash

from tools.capture_vllm_events import CapturedMessage, load_capture, load_manifest

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "vllm_events"
MANIFEST = load_manifest(FIXTURES)
SCENARIOS: dict[str, dict[str, Any]] = MANIFEST["scenarios"]
MASK64 = (1 << 64) - 1


def pub_messages(scenario: str) -> list[CapturedMessage]:
    return [m for m in load_capture(FIXTURES, scenario) if m.source == "pub"]


def raw_events(scenario: str) -> Iterator[tuple[int, dict[str, Any]]]:
    """(seq, event map) for every published event, decoded with plain msgpack."""
    for m in pub_messages(scenario):
        _ts, events, _rank = msgspec.msgpack.decode(m.payload)
        for ev in events:
            yield m.seq, ev


def request(scenario: str, name: str) -> dict[str, Any]:
    for r in SCENARIOS[scenario]["requests"]:
        if r["name"] == name:
            return r
    raise KeyError(f"{scenario} has no request {name!r}")


def stored_after(scenario: str, name: str) -> list[dict[str, Any]]:
    """BlockStored events published in the batches that followed request ``name``."""
    seqs = set(request(scenario, name)["seqs_after"])
    return [ev for seq, ev in raw_events(scenario) if seq in seqs and ev["type"] == "BlockStored"]


# --- the engine's own hash, recomputed (vllm/v1/core/kv_cache_utils.py) ----------------


def _pickle_hash(algo: str, obj: object) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    if algo == "sha256":
        return hashlib.sha256(data).digest()
    if algo == "xxhash":
        return xxhash.xxh3_128_digest(data)
    raise ValueError(f"no reference for {algo}")


def reference_engine_hashes(
    algo: str,
    seed: str | None,
    token_ids: list[int],
    block_size: int,
    *,
    cache_salt: str | None = None,
    as_int: bool = True,
) -> list[int | bytes]:
    """vLLM's block hashes: ``d_i = H((d_{i-1} or NONE_HASH, tuple(block_i), extra_i))``,
    ``NONE_HASH = H(seed)``, ``extra_0 = (("cache_salt", salt),)`` when salted, published
    as ``int.from_bytes(d_i, "big") & (2**64 - 1)`` or as raw bytes."""
    parent = _pickle_hash(algo, seed if seed is not None else "vllm-none-hash")
    out: list[int | bytes] = []
    for i in range(len(token_ids) // block_size):
        block = tuple(token_ids[i * block_size : (i + 1) * block_size])
        extra = (("cache_salt", cache_salt),) if (i == 0 and cache_salt) else None
        parent = _pickle_hash(algo, (parent, block, extra))
        out.append(int.from_bytes(parent, "big") & MASK64 if as_int else parent)
    return out


# --- framing ---------------------------------------------------------------------------


def test_fixtures_are_small_and_every_scenario_file_exists() -> None:
    total = sum(p.stat().st_size for p in FIXTURES.iterdir())
    assert total < 1_000_000
    assert {"sha256_int", "sha256_bytes", "xxhash_int_seed42"} <= set(SCENARIOS)
    for entry in SCENARIOS.values():
        assert (FIXTURES / entry["file"]).is_file()
        assert entry["vllm_version"].startswith("0.32")


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_pub_messages_are_topic_seq_payload_with_seq_counting_up_from_zero(
    scenario: str,
) -> None:
    msgs = pub_messages(scenario)
    assert msgs
    for m in msgs:
        assert len(m.frames) == 3
        assert len(m.frames[1]) == 8  # seq: 8 bytes big-endian
        assert m.topic == b"kv-events"  # serve.sh's topic
    assert [m.seq for m in msgs] == list(range(len(msgs)))


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_replay_resends_buffered_batches_from_start_seq_then_an_end_frame(
    scenario: str,
) -> None:
    pub = {m.seq: m for m in pub_messages(scenario)}
    replayed = [m for m in load_capture(FIXTURES, scenario) if m.is_replay]
    for start in SCENARIOS[scenario]["replay_start_seqs"]:
        reply = [m for m in replayed if m.source == f"replay:{start}"]
        body, end = reply[:-1], reply[-1]
        # every reply is [b"", topic, seq, payload] on the DEALER side
        assert all(len(m.frames) == 4 and m.frames[0] == b"" for m in reply)
        assert [m.seq for m in body] == [s for s in sorted(pub) if s >= start]
        for m in body:
            assert m.topic == pub[m.seq].topic
            assert m.payload == pub[m.seq].payload  # byte-identical to the live batch
        # the end marker: empty topic, seq -1 (signed), empty payload
        assert end.frames == (b"", b"", (-1).to_bytes(8, "big", signed=True), b"")


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_payload_is_msgpack_ts_events_rank_with_each_event_a_map_tagged_by_type(
    scenario: str,
) -> None:
    for m in pub_messages(scenario):
        batch = msgspec.msgpack.decode(m.payload)
        assert isinstance(batch, list) and len(batch) == 3
        ts, events, rank = batch
        assert isinstance(ts, float) and ts > 1.7e9  # unix seconds
        assert rank == 0  # data_parallel_rank is filled in by the publisher
        for ev in events:
            assert isinstance(ev, dict)
            assert ev["type"] in {"BlockStored", "BlockRemoved", "AllBlocksCleared"}


def test_block_stored_carries_every_non_default_field_and_omits_default_ones() -> None:
    ev = stored_after("sha256_int", "completion_a")[0]
    # required fields are always present, even when None
    assert ev["parent_block_hash"] is None and ev["lora_id"] is None and ev["lora_name"] is None
    assert ev["medium"] == "GPU"  # on a CPU engine too
    assert ev["block_size"] == 32
    assert ev["group_idx"] == 0 and ev["kv_cache_spec_kind"] == "full_attention"
    # extra_keys is a list with one entry per block (None when the block has none)
    assert ev["extra_keys"] == [None] * len(ev["block_hashes"])
    # defaulted optional fields are left out
    for absent in ("kv_cache_spec_sliding_window", "locality", "ownership", "session_id"):
        assert absent not in ev


def test_block_removed_is_one_hash_per_event_with_medium_and_group() -> None:
    removed = [ev for _, ev in raw_events("sha256_int") if ev["type"] == "BlockRemoved"]
    assert removed
    for ev in removed:
        assert set(ev) == {"type", "block_hashes", "medium", "group_idx"}
        assert len(ev["block_hashes"]) == 1 and ev["medium"] == "GPU"


def test_all_blocks_cleared_is_an_empty_map_published_at_the_next_engine_step() -> None:
    reset = request("sha256_int", "reset_prefix_cache")
    assert reset["seqs_after"] == []  # nothing is published by the reset itself
    after = set(request("sha256_int", "after_reset")["seqs_after"])
    first = next(ev for seq, ev in raw_events("sha256_int") if seq in after)
    assert first == {"type": "AllBlocksCleared"}


# --- content ---------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_block_stored_token_ids_are_the_tokenize_ids_of_the_prompt_in_full_blocks(
    scenario: str,
) -> None:
    req = request(scenario, "completion_a")
    (ev,) = stored_after(scenario, "completion_a")
    n = len(ev["block_hashes"])
    assert n == len(req["token_ids"]) // 32  # only full blocks; the partial tail is not
    assert ev["token_ids"] == req["token_ids"][: n * 32]


def test_a_prefix_cache_hit_publishes_nothing() -> None:
    assert request("sha256_int", "completion_a_repeat_hit")["seqs_after"] == []


def test_a_prompt_sharing_a_prefix_stores_only_its_new_blocks_chained_to_the_shared_one() -> None:
    a = request("sha256_int", "completion_a")["token_ids"]
    b = request("sha256_int", "completion_b_shared_prefix")["token_ids"]
    shared = 0
    while a[(shared) * 32 : (shared + 1) * 32] == b[shared * 32 : (shared + 1) * 32]:
        shared += 1
    (first,) = stored_after("sha256_int", "completion_a")
    (second,) = stored_after("sha256_int", "completion_b_shared_prefix")
    assert shared >= 2
    assert second["parent_block_hash"] == first["block_hashes"][shared - 1]
    assert second["token_ids"] == b[shared * 32 : (shared + len(second["block_hashes"])) * 32]


def test_cache_salt_is_an_untagged_extra_key_on_block_0_and_changes_every_hash() -> None:
    (plain,) = stored_after("sha256_int", "completion_a")
    (salted,) = stored_after("sha256_int", "completion_a_salted")
    assert salted["token_ids"] == plain["token_ids"]
    assert salted["extra_keys"][0] == ["tenant-a"]  # published untagged, as a list
    assert all(k is None for k in salted["extra_keys"][1:])
    assert not set(salted["block_hashes"]) & set(plain["block_hashes"])


def test_int_mode_hashes_are_unsigned_64_bit_and_bytes_mode_hashes_are_32_byte_digests() -> None:
    ints = [h for _, ev in raw_events("sha256_int") for h in ev.get("block_hashes", [])]
    assert ints and all(isinstance(h, int) and 0 <= h <= MASK64 for h in ints)
    raw = [h for _, ev in raw_events("sha256_bytes") for h in ev.get("block_hashes", [])]
    assert raw and all(isinstance(h, bytes) and len(h) == 32 for h in raw)
    # the int is the last 8 bytes of the digest, big-endian: the same prompt gives both
    (as_int,) = stored_after("sha256_int", "completion_a")
    (as_bytes,) = stored_after("sha256_bytes", "completion_a")
    assert [int.from_bytes(h, "big") & MASK64 for h in as_bytes["block_hashes"]] == as_int[
        "block_hashes"
    ]


def test_eviction_takes_the_oldest_request_first_and_its_tail_first() -> None:
    removed = [
        ev["block_hashes"][0] for _, ev in raw_events("sha256_int") if ev["type"] == "BlockRemoved"
    ]
    after_reset = stored_after("sha256_int", "after_reset")[0]["block_hashes"]
    # the oldest chain still cached (stored after the reset) goes first, last block first
    assert removed[: len(after_reset)] == list(reversed(after_reset))


# --- the engine's hash can be recomputed from the token ids ------------------------------


@pytest.mark.parametrize(
    ("scenario", "name"),
    [
        (s, n)
        for s in ("sha256_int", "sha256_bytes", "xxhash_int_seed42")
        for n in ("completion_a", "completion_a_salted", "chat_a", "after_reset")
    ],
)
def test_the_documented_hash_formula_reproduces_the_real_engine_hashes(
    scenario: str, name: str
) -> None:
    entry = SCENARIOS[scenario]
    req = request(scenario, name)
    ev = next(e for e in stored_after(scenario, name) if e["parent_block_hash"] is None)
    expected = reference_engine_hashes(
        entry["hash_algo"],
        entry["env"]["PYTHONHASHSEED"],
        req["token_ids"],
        entry["block_size"],
        cache_salt=req.get("cache_salt"),
        as_int=entry["int_hashes"],
    )
    assert ev["block_hashes"] == expected[: len(ev["block_hashes"])]


def test_xxhash_without_the_engines_seed_does_not_reproduce_its_hashes() -> None:
    req = request("xxhash_int_seed42", "completion_a")
    (ev,) = stored_after("xxhash_int_seed42", "completion_a")
    wrong = reference_engine_hashes("xxhash", "43", req["token_ids"], 32)
    assert not set(wrong) & set(ev["block_hashes"])
