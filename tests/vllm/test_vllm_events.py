"""Live: a real vLLM CPU engine's KV events, read with a raw ZMQ SUB socket.

Opt-in (``pytest -m vllm tests/vllm``); skipped with a reason when the engine is not
installed.  The same facts as ``tests/scoring/test_real_vllm_payloads.py`` (which runs
on captured frames), checked against a running engine, plus the project's decoder and
index applied to what it publishes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import msgspec
import pytest

from scoring.blocks import BlockHasher
from scoring.events import EngineHasher, KVEventApplier
from scoring.index.memory import InMemoryIndex
from tests.scoring.test_real_vllm_payloads import reference_engine_hashes
from tests.vllm.conftest import EngineFactory
from tools.capture_vllm_events import EngineProcess, FrameRecorder, replay

pytestmark = pytest.mark.vllm

MODEL = "tiny-llama"
BLOCK = 32
PREFIX = "A shared system prompt about routing requests to the pod holding their prefix. " * 6


@pytest.fixture(scope="module")
def sha_engine(engine: EngineFactory) -> EngineProcess:
    return engine("events", hash_algo="sha256", int_hashes=True)


@pytest.fixture
def recorder(sha_engine: EngineProcess) -> Iterator[FrameRecorder]:
    rec = FrameRecorder(sha_engine.pub_endpoint)
    rec.start()
    rec.wait_quiet(quiet=0.5)  # let the SUB connection settle (slow joiner)
    yield rec
    rec.stop()


def _client(engine: EngineProcess) -> httpx.Client:
    return httpx.Client(base_url=engine.base_url, timeout=120.0)


def _complete(client: httpx.Client, prompt: str, **extra: Any) -> list[int]:
    """Send a completion; return the /tokenize ids of its prompt."""
    ids = [int(t) for t in client.post("/tokenize", json={"prompt": prompt}).json()["tokens"]]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0.0, **extra}
    client.post("/v1/completions", json=body).raise_for_status()
    return ids


def _record_completion(proc: EngineProcess, prompt: str) -> tuple[list[int], list[Any]]:
    """Complete ``prompt`` on ``proc``; its token ids and the event frames it published."""
    rec = FrameRecorder(proc.pub_endpoint)
    rec.start()
    try:
        rec.wait_quiet(quiet=0.5)  # let the SUB connection settle (slow joiner)
        with _client(proc) as client:
            first = rec.count()
            ids = _complete(client, prompt)
            rec.wait_quiet()
        return ids, rec.messages[first:]
    finally:
        rec.stop()


def _events(messages: list[list[bytes]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for _topic, _seq, payload in messages:
        out += msgspec.msgpack.decode(payload)[1]
    return out


def _metric(client: httpx.Client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_block_stored_token_ids_equal_tokenize_ids_and_hashes_follow_the_formula(
    sha_engine: EngineProcess, recorder: FrameRecorder
) -> None:
    with _client(sha_engine) as client:
        first = recorder.count()
        ids = _complete(client, PREFIX + "Live question one.")
        recorder.wait_quiet()
    stored = [e for e in _events(recorder.messages[first:]) if e["type"] == "BlockStored"]
    assert stored, "the engine published no BlockStored for a new prompt"
    ev = stored[0]
    n = len(ev["block_hashes"])
    assert ev["parent_block_hash"] is None and n == len(ids) // BLOCK
    assert ev["token_ids"] == ids[: n * BLOCK]
    assert ev["block_hashes"] == reference_engine_hashes("sha256", None, ids, BLOCK)


def test_seq_is_8_byte_big_endian_and_consecutive(
    sha_engine: EngineProcess, recorder: FrameRecorder
) -> None:
    with _client(sha_engine) as client:
        first = recorder.count()
        _complete(client, PREFIX + "Live question two, a different tail for new blocks.")
        _complete(client, "Something else entirely, long enough to fill a block. " * 4)
        recorder.wait_quiet()
    msgs = recorder.messages[first:]
    assert len(msgs) >= 2
    seqs = [int.from_bytes(m[1], "big") for m in msgs]
    assert all(len(m) == 3 and len(m[1]) == 8 for m in msgs)
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))


def test_replay_returns_the_requested_batches_then_the_end_frame(
    sha_engine: EngineProcess, recorder: FrameRecorder
) -> None:
    with _client(sha_engine) as client:
        first = recorder.count()
        _complete(client, "Replay me: a prompt with a few full blocks of its own. " * 4)
        recorder.wait_quiet()
    live = recorder.messages[first:]
    start = int.from_bytes(live[0][1], "big")
    reply = replay(sha_engine.replay_endpoint, start)
    assert reply[-1] == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
    by_seq = {int.from_bytes(m[1], "big"): m for m in live}
    replayed = {int.from_bytes(m[2], "big"): m for m in reply[:-1]}
    for seq, m in by_seq.items():
        assert replayed[seq] == [b"", *m]


def test_reset_prefix_cache_publishes_all_blocks_cleared_with_the_next_step(
    sha_engine: EngineProcess, recorder: FrameRecorder
) -> None:
    with _client(sha_engine) as client:
        client.post("/reset_prefix_cache").raise_for_status()
        recorder.wait_quiet()
        first = recorder.count()
        _complete(client, "After the reset. " * 3)
        recorder.wait_quiet()
    events = _events(recorder.messages[first:])
    assert {"type": "AllBlocksCleared"} in events


def _aligned_prompt(client: httpx.Client, text: str, *, aligned: bool) -> str:
    """``text`` plus filler words until its token count is (or is not) a multiple of 32."""
    prompt = text
    for _ in range(200):
        n = len(client.post("/tokenize", json={"prompt": prompt}).json()["tokens"])
        if (n % BLOCK == 0) == aligned:
            return prompt
        prompt += " x"
    raise AssertionError("could not pad the prompt to the wanted length")


def test_repeating_a_prompt_that_ends_mid_block_publishes_nothing(
    sha_engine: EngineProcess, recorder: FrameRecorder
) -> None:
    with _client(sha_engine) as client:
        prompt = _aligned_prompt(client, "Repeat me, unaligned. " * 10, aligned=False)
        ids = _complete(client, prompt)
        recorder.wait_quiet()
        hits_before = _metric(client, "vllm:prefix_cache_hits_total")
        first = recorder.count()
        _complete(client, prompt)
        recorder.wait_quiet()
        hits_after = _metric(client, "vllm:prefix_cache_hits_total")
    assert _events(recorder.messages[first:]) == []
    # the counter is in tokens: every full prompt block was served from cache
    assert hits_after - hits_before == (len(ids) // BLOCK) * BLOCK


def test_repeating_a_block_aligned_prompt_stores_its_last_block_again_with_the_same_hash(
    sha_engine: EngineProcess, recorder: FrameRecorder
) -> None:
    """vLLM recomputes at least the prompt's last token, so a fully cached prompt whose
    length is a multiple of the block size hits all but its last block, recomputes that
    one, and publishes it again: the same hash stored twice on one pod."""
    with _client(sha_engine) as client:
        prompt = _aligned_prompt(client, "Repeat me, aligned. " * 10, aligned=True)
        first = recorder.count()
        ids = _complete(client, prompt)
        recorder.wait_quiet()
        hits_before = _metric(client, "vllm:prefix_cache_hits_total")
        second = recorder.count()
        _complete(client, prompt)
        recorder.wait_quiet()
        hits_after = _metric(client, "vllm:prefix_cache_hits_total")
    (stored,) = [e for e in _events(recorder.messages[first:second]) if e["type"] == "BlockStored"]
    again = _events(recorder.messages[second:])
    assert [e["type"] for e in again] == ["BlockStored"]
    assert again[0]["block_hashes"] == stored["block_hashes"][-1:]
    assert again[0]["parent_block_hash"] == stored["block_hashes"][-2]
    assert again[0]["token_ids"] == ids[-BLOCK:]
    assert hits_after - hits_before == len(ids) - BLOCK


async def test_the_project_applier_and_index_find_the_engine_holding_a_prompt(
    sha_engine: EngineProcess, recorder: FrameRecorder
) -> None:
    prompt = "Index me: a prompt no earlier test sent, so its chain starts here. " * 5
    with _client(sha_engine) as client:
        first = recorder.count()
        ids = _complete(client, prompt)
        recorder.wait_quiet()
    applier = KVEventApplier(engine_hasher=EngineHasher("sha256"))
    applier.set_pod("pod-a", MODEL)
    index = InMemoryIndex()
    for _topic, _seq, payload in recorder.messages[first:]:
        await applier.ingest("pod-a", payload).apply(index)
    keys = BlockHasher(block_size=BLOCK, model=MODEL).keys(ids)
    hits = await index.lookup(keys)
    assert hits["pod-a"]["GPU"] == len(keys)
    assert applier.hasher is not None and applier.hasher.matches >= 1
    assert applier.hasher.mismatches == 0
    assert applier.stats.decode_errors == 0 and applier.stats.bad_events == 0


async def test_a_late_joining_applier_recovers_an_orphan_chain_in_engine_hash_mode(
    sha_engine: EngineProcess, recorder: FrameRecorder
) -> None:
    """The engine already holds a prefix (stored before we listened); a request extending
    it publishes only its new blocks, whose parent we never saw.  Learning the routed
    request's token ids in engine-hash mode links them."""
    base = "Late join: the prefix was stored before the subscriber arrived. " * 4
    with _client(sha_engine) as client:
        _complete(client, base)  # stored while "we" were not listening
        recorder.wait_quiet()
        first = recorder.count()
        ids = _complete(client, base + "And this request extends it with new blocks. " * 4)
        recorder.wait_quiet()
    applier = KVEventApplier(engine_hasher=EngineHasher("sha256"))
    applier.set_pod("pod-a", MODEL)
    index = InMemoryIndex()
    for _topic, _seq, payload in recorder.messages[first:]:
        await applier.ingest("pod-a", payload).apply(index)
    keys = BlockHasher(block_size=BLOCK, model=MODEL).keys(ids)
    assert applier.stats.orphaned_blocks > 0
    assert "pod-a" not in await index.lookup(keys)
    await applier.learn(MODEL, ids, BLOCK).apply(index)
    assert (await index.lookup(keys))["pod-a"]["GPU"] == len(keys)
    assert applier.stats.engine_hash_linked > 0


def test_bytes_mode_engine_publishes_32_byte_digests_whose_tail_is_the_int_hash(
    engine: EngineFactory,
) -> None:
    proc = engine("bytes", hash_algo="sha256", int_hashes=False)
    try:
        ids, msgs = _record_completion(proc, PREFIX + "Bytes mode.")
    finally:
        engine.stop(proc)
    stored = [e for e in _events(msgs) if e["type"] == "BlockStored"]
    assert stored
    hashes = stored[0]["block_hashes"]
    assert all(isinstance(h, bytes) and len(h) == 32 for h in hashes)
    as_int = reference_engine_hashes("sha256", None, ids, BLOCK)
    assert [int.from_bytes(h, "big") & ((1 << 64) - 1) for h in hashes] == as_int[: len(hashes)]


async def test_unseeded_xxhash_engines_disagree_on_hashes_but_our_keys_agree(
    engine: EngineFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The PYTHONHASHSEED trap: without it, each xxhash engine seeds NONE_HASH randomly,
    so two engines publish different hashes for the same prompt.  Keys derived from the
    published token ids do not care."""
    procs = engine.many(["xx-0", "xx-1"], hash_algo="xxhash")
    try:
        prompt = "Same prompt on two unseeded xxhash engines. " * 8
        stored: list[dict[str, Any]] = []
        applier = KVEventApplier()
        index = InMemoryIndex()
        for i, proc in enumerate(procs):
            applier.set_pod(f"pod-{i}", MODEL)
            ids, msgs = _record_completion(proc, prompt)
            stored.append(next(e for e in _events(msgs) if e["type"] == "BlockStored"))
            for _topic, _seq, payload in msgs:
                await applier.ingest(f"pod-{i}", payload).apply(index)
        assert stored[0]["token_ids"] == stored[1]["token_ids"]
        assert not set(stored[0]["block_hashes"]) & set(stored[1]["block_hashes"])
        keys = BlockHasher(block_size=BLOCK, model=MODEL).keys(ids)
        hits = await index.lookup(keys)
        assert {pod: h["GPU"] for pod, h in hits.items()} == {
            "pod-0": len(keys),
            "pod-1": len(keys),
        }
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
        with pytest.raises(ValueError, match="PYTHONHASHSEED"):
            EngineHasher("xxhash")  # no seed: it refuses rather than mismatch silently
    finally:
        engine.stop(*procs)
