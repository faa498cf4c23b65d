"""What a real vLLM 0.32 CPU engine puts on the wire, from captured frames.

The fixtures in ``tests/fixtures/vllm_events/`` were produced by
``python tools/capture_vllm_events.py`` against real engines (see its manifest: engine
version, hash algorithm, int or bytes hashes, PYTHONHASHSEED, every request sent with the
``/tokenize`` ids of its prompt).  These tests need no engine: they pin down the wire
format the router decodes, and check that the project's decoder and index understand it.
"""

from __future__ import annotations

import hashlib
import itertools
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cbor2
import msgspec
import pytest
import xxhash

from scoring.blocks import BlockHasher
from scoring.events import (
    BlockRemoved,
    BlockStored,
    EngineHasher,
    KVEventApplier,
    decode_batch,
)
from scoring.index.memory import InMemoryIndex
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


def _engine_hash(algo: str, obj: object) -> bytes:
    """``vllm.utils.hashing``: sha256 / xxh3_128 over pickle, or over canonical CBOR."""
    if algo.endswith("_cbor"):
        data = cbor2.dumps(obj, canonical=True)
    else:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    if algo.startswith("sha256"):
        return hashlib.sha256(data).digest()
    if algo.startswith("xxhash"):
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
    parent = _engine_hash(algo, seed if seed is not None else "vllm-none-hash")
    out: list[int | bytes] = []
    for i in range(len(token_ids) // block_size):
        block = tuple(token_ids[i * block_size : (i + 1) * block_size])
        extra = (("cache_salt", cache_salt),) if (i == 0 and cache_salt) else None
        parent = _engine_hash(algo, (parent, block, extra))
        out.append(int.from_bytes(parent, "big") & MASK64 if as_int else parent)
    return out


# --- framing ---------------------------------------------------------------------------


def test_fixtures_are_small_and_every_scenario_file_exists() -> None:
    total = sum(p.stat().st_size for p in FIXTURES.iterdir())
    assert total < 1_000_000
    assert {"sha256_int", "sha256_bytes", "sha256_int_seed7", "xxhash_int_seed42"} <= set(SCENARIOS)
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


def test_generated_tokens_are_published_once_they_fill_a_block() -> None:
    req = request("sha256_int", "completion_generates_blocks")
    prompt, generated = req["token_ids"], req["usage"]["completion_tokens"]
    stored = stored_after("sha256_int", "completion_generates_blocks")
    tokens = [t for ev in stored for t in ev["token_ids"]]
    # every full block of prompt + generated tokens (but the last, not yet computed)
    assert len(tokens) == ((len(prompt) + generated - 1) // 32) * 32 > len(prompt)
    assert tokens[: len(prompt)] == prompt
    # one chain: each later event continues from the previous one's last block
    for prev, ev in itertools.pairwise(stored):
        assert ev["parent_block_hash"] == prev["block_hashes"][-1]


def test_repeating_a_block_aligned_prompt_stores_its_last_block_again_with_the_same_hash() -> None:
    req = request("sha256_int", "completion_block_aligned")
    assert len(req["token_ids"]) % 32 == 0
    (first,) = stored_after("sha256_int", "completion_block_aligned")
    (again,) = stored_after("sha256_int", "completion_block_aligned_repeat")
    assert again["block_hashes"] == first["block_hashes"][-1:]
    assert again["parent_block_hash"] == first["block_hashes"][-2]
    assert again["token_ids"] == req["token_ids"][-32:]


async def test_a_block_stored_twice_stays_indexed_until_both_copies_are_removed() -> None:
    applier, index = _applier("sha256_int"), InMemoryIndex()
    seqs = {
        n: request("sha256_int", n)["seqs_after"]
        for n in ("completion_block_aligned", "completion_block_aligned_repeat")
    }
    await _apply_seqs(applier, index, "sha256_int", seqs["completion_block_aligned"])
    await _apply_seqs(applier, index, "sha256_int", seqs["completion_block_aligned_repeat"])
    keys = _keys("sha256_int", "completion_block_aligned")
    (again,) = stored_after("sha256_int", "completion_block_aligned_repeat")
    last = again["block_hashes"][0]
    ops = applier.apply(POD, BlockRemoved(block_hashes=[last], medium="GPU"))
    await ops.apply(index)
    assert await _held(index, keys) == len(keys)  # one physical copy is left
    await applier.apply(POD, BlockRemoved(block_hashes=[last], medium="GPU")).apply(index)
    assert await _held(index, keys) == len(keys) - 1


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


def test_xxhash_bytes_mode_hashes_are_16_byte_digests_whose_tail_is_the_int_hash() -> None:
    raw = [h for _, ev in raw_events("xxhash_bytes_seed42") for h in ev.get("block_hashes", [])]
    assert raw and all(isinstance(h, bytes) and len(h) == 16 for h in raw)
    (as_int,) = stored_after("xxhash_int_seed42", "completion_a")
    (as_bytes,) = stored_after("xxhash_bytes_seed42", "completion_a")
    assert [int.from_bytes(h, "big") & MASK64 for h in as_bytes["block_hashes"]] == as_int[
        "block_hashes"
    ]


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
        for s in sorted(SCENARIOS)
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


def test_pythonhashseed_changes_the_sha256_hashes_too() -> None:
    (default,) = stored_after("sha256_int", "completion_a")
    (seeded,) = stored_after("sha256_int_seed7", "completion_a")
    same_prompt = request("sha256_int", "completion_a")["token_ids"]
    assert request("sha256_int_seed7", "completion_a")["token_ids"] == same_prompt
    assert seeded["token_ids"] == default["token_ids"]
    assert not set(seeded["block_hashes"]) & set(default["block_hashes"])


def test_xxhash_without_the_engines_seed_does_not_reproduce_its_hashes() -> None:
    req = request("xxhash_int_seed42", "completion_a")
    (ev,) = stored_after("xxhash_int_seed42", "completion_a")
    wrong = reference_engine_hashes("xxhash", "43", req["token_ids"], 32)
    assert not set(wrong) & set(ev["block_hashes"])


# --- the project's decoder, applier, index and engine-hash mode on the real frames -------

POD = "pod-a"
EVICT = ("evict_0", "evict_1", "evict_2")


def _applier(scenario: str, **kwargs: Any) -> KVEventApplier:
    applier = KVEventApplier(**kwargs)
    applier.set_pod(POD, SCENARIOS[scenario]["served_model_name"])
    return applier


def _keys(scenario: str, name: str, *, cache_salt: str | None = None) -> list[int]:
    entry = SCENARIOS[scenario]
    hasher = BlockHasher(block_size=entry["block_size"], model=entry["served_model_name"])
    return hasher.keys(request(scenario, name)["token_ids"], cache_salt=cache_salt)


async def _held(index: InMemoryIndex, keys: list[int]) -> int:
    """Leading blocks of ``keys`` the index says POD holds in the GPU tier."""
    hits = await index.lookup(keys)
    return hits[POD]["GPU"] if POD in hits else 0


async def _apply_seqs(
    applier: KVEventApplier, index: InMemoryIndex, scenario: str, seqs: list[int]
) -> None:
    payloads = {m.seq: m.payload for m in pub_messages(scenario)}
    for seq in seqs:
        await applier.ingest(POD, payloads[seq]).apply(index)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_the_project_decoder_reads_every_captured_batch_without_errors(scenario: str) -> None:
    for m in pub_messages(scenario):
        batch = decode_batch(m.payload)
        assert batch.errors == [] and batch.unknown == 0
        assert batch.data_parallel_rank == 0
        raw = msgspec.msgpack.decode(m.payload)[1]
        assert [type(e).__name__ for e in batch.events] == [e["type"] for e in raw]
        for ev, r in zip(batch.events, raw, strict=True):
            if isinstance(ev, (BlockStored, BlockRemoved)):
                assert ev.block_hashes == r["block_hashes"]  # ints stay ints, bytes bytes
            if isinstance(ev, BlockStored):
                assert ev.parent_block_hash == r["parent_block_hash"]
                assert ev.token_ids == r["token_ids"] and ev.block_size == 32


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
async def test_after_each_request_the_index_finds_the_pod_holding_its_full_prompt_blocks(
    scenario: str,
) -> None:
    applier, index = _applier(scenario), InMemoryIndex()
    for req in SCENARIOS[scenario]["requests"]:
        await _apply_seqs(applier, index, scenario, req["seqs_after"])
        if req["kind"] == "reset":
            continue
        keys = _keys(scenario, req["name"], cache_salt=req.get("cache_salt"))
        assert await _held(index, keys) == len(req["token_ids"]) // 32, req["name"]
    assert applier.stats.orphaned_blocks == 0
    assert applier.stats.unknown_removed == 0
    assert applier.stats.bad_events == 0 and applier.stats.decode_errors == 0


async def test_a_salted_chain_is_found_only_with_the_same_salt() -> None:
    applier, index = _applier("sha256_int"), InMemoryIndex()
    await _apply_seqs(applier, index, "sha256_int", [0, 1, 2])  # a, b, a salted
    (salted,) = stored_after("sha256_int", "completion_a_salted")
    assert salted["extra_keys"][0] == ["tenant-a"]
    n = len(request("sha256_int", "completion_a")["token_ids"]) // 32
    assert await _held(index, _keys("sha256_int", "completion_a", cache_salt="tenant-a")) == n
    assert await _held(index, _keys("sha256_int", "completion_a", cache_salt="tenant-b")) == 0
    assert not set(_keys("sha256_int", "completion_a", cache_salt="tenant-a")) & set(
        _keys("sha256_int", "completion_a")
    )


async def test_all_blocks_cleared_empties_the_pod_before_the_next_chain_is_stored() -> None:
    applier, index = _applier("sha256_int"), InMemoryIndex()
    before = [s for r in SCENARIOS["sha256_int"]["requests"][:6] for s in r["seqs_after"]]
    await _apply_seqs(applier, index, "sha256_int", before)
    assert await _held(index, _keys("sha256_int", "chat_a")) > 0
    await _apply_seqs(
        applier, index, "sha256_int", request("sha256_int", "after_reset")["seqs_after"]
    )
    assert await _held(index, _keys("sha256_int", "chat_a")) == 0
    assert (
        await _held(index, _keys("sha256_int", "completion_a_salted", cache_salt="tenant-a")) == 0
    )
    # only what after_reset stored: its own chain, and the blocks q1 shares with it
    a = _keys("sha256_int", "completion_a")
    b = _keys("sha256_int", "completion_b_shared_prefix")
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert await _held(index, a) == shared
    assert await _held(index, b) == len(b)
    assert applier.stats.cleared == 1


async def test_eviction_events_shrink_the_oldest_chain_from_its_end() -> None:
    applier, index = _applier("sha256_int"), InMemoryIndex()
    seqs = [s for r in SCENARIOS["sha256_int"]["requests"] for s in r["seqs_after"]]
    await _apply_seqs(applier, index, "sha256_int", seqs)
    removed = applier.stats.removed_blocks
    after_reset = _keys("sha256_int", "after_reset")
    assert removed > len(after_reset)  # the whole oldest chain, then the next one's tail
    assert await _held(index, after_reset) == 0
    evict_0 = _keys("sha256_int", "evict_0")
    assert await _held(index, evict_0) == len(evict_0) - (removed - len(after_reset))
    for name in EVICT[1:]:
        assert await _held(index, _keys("sha256_int", name)) == len(_keys("sha256_int", name))


async def test_a_late_joiner_counts_the_orphan_and_links_it_when_replay_brings_the_parent() -> None:
    applier, index = _applier("sha256_int"), InMemoryIndex()
    b = _keys("sha256_int", "completion_b_shared_prefix")
    await _apply_seqs(applier, index, "sha256_int", [1])  # missed seq 0: b's parent unknown
    pod_state = applier.pod(POD)
    assert pod_state is not None and pod_state.needs_resync
    assert applier.stats.orphaned_blocks == len(
        stored_after("sha256_int", "completion_b_shared_prefix")[0]["block_hashes"]
    )
    assert await _held(index, b) == 0
    replayed = next(
        m for m in load_capture(FIXTURES, "sha256_int") if m.source == "replay:0" and m.seq == 0
    )
    await applier.ingest(POD, replayed.payload).apply(index)
    assert await _held(index, b) == len(b)
    assert applier.stats.orphans_linked > 0 and not pod_state.needs_resync


@pytest.mark.parametrize(
    ("scenario", "name"),
    [
        (s, n)
        for s in sorted(SCENARIOS)
        for n in ("completion_a", "completion_a_salted", "chat_a", "after_reset", "evict_0")
        if any(r["name"] == n for r in SCENARIOS[s]["requests"])
    ],
)
def test_engine_hasher_reproduces_the_real_engine_hashes_from_tokenize_ids(
    scenario: str, name: str
) -> None:
    entry = SCENARIOS[scenario]
    req = request(scenario, name)
    hasher = EngineHasher(entry["hash_algo"], entry["env"]["PYTHONHASHSEED"])
    hasher.int_hashes = entry["int_hashes"]
    ev = next(e for e in stored_after(scenario, name) if e["parent_block_hash"] is None)
    digests = hasher.chain(req["token_ids"], 32, cache_salt=req.get("cache_salt"))
    assert [hasher.published(d) for d in digests[: len(ev["block_hashes"])]] == ev["block_hashes"]


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_engine_hasher_verifies_every_real_block_stored(scenario: str) -> None:
    entry = SCENARIOS[scenario]
    hasher = EngineHasher(entry["hash_algo"], entry["env"]["PYTHONHASHSEED"])
    for m in pub_messages(scenario):
        for ev in decode_batch(m.payload).events:
            if isinstance(ev, BlockStored):
                assert hasher.verify(ev) is True
    assert hasher.mismatches == 0 and hasher.enabled
    assert hasher.int_hashes is entry["int_hashes"]


def test_engine_hasher_with_the_wrong_seed_reports_a_mismatch_and_disables_itself() -> None:
    hasher = EngineHasher("sha256", seed="42")  # the sha256 engine ran without PYTHONHASHSEED
    (m,) = [x for x in pub_messages("sha256_int") if x.seq == 0]
    ev = decode_batch(m.payload).events[0]
    assert isinstance(ev, BlockStored)
    assert hasher.verify(ev) is False
    assert hasher.mismatches == 1 and not hasher.enabled


async def test_engine_hash_mode_recovers_an_orphan_from_a_routed_requests_tokens() -> None:
    entry = SCENARIOS["sha256_int"]
    applier = _applier("sha256_int", engine_hasher=EngineHasher("sha256"))
    index = InMemoryIndex()
    await _apply_seqs(applier, index, "sha256_int", [1])  # b's parent (seq 0) was missed
    assert applier.stats.orphaned_blocks > 0
    a = request("sha256_int", "completion_a")["token_ids"]
    ops = applier.learn(entry["served_model_name"], a, 32)  # the router routed a earlier
    await ops.apply(index)
    b = _keys("sha256_int", "completion_b_shared_prefix")
    assert await _held(index, b) == len(b)
    assert applier.stats.engine_hash_linked > 0


# --- the simulated pod speaks the same bytes -------------------------------------------


def _sim_event(factory: Any, ev: dict[str, Any]) -> Any:
    if ev["type"] == "BlockStored":
        return factory.stored(
            ev["block_hashes"],
            ev["parent_block_hash"],
            ev["token_ids"],
            ev["block_size"],
            lora_id=ev["lora_id"],
            lora_name=ev["lora_name"],
            extra_keys=[tuple(k) if k is not None else None for k in ev["extra_keys"]],
        )
    if ev["type"] == "BlockRemoved":
        (h,) = ev["block_hashes"]
        return factory.removed(h)
    return factory.cleared()


@pytest.mark.parametrize("scenario", ["sha256_int", "sha256_bytes", "xxhash_bytes_seed42"])
def test_the_simulated_pod_encodes_the_real_engines_batches_byte_for_byte(scenario: str) -> None:
    from router.sim.events import EventBatch as SimBatch
    from router.sim.events import EventFactory

    factory = EventFactory("map")
    encoder = msgspec.msgpack.Encoder()
    for m in pub_messages(scenario):
        ts, events, rank = msgspec.msgpack.decode(m.payload)
        sim = SimBatch(ts=ts, events=[_sim_event(factory, e) for e in events])
        sim.data_parallel_rank = rank
        assert encoder.encode(sim) == m.payload, f"seq {m.seq}"
