"""Token ids -> block key chains (scoring/blocks.py)."""

from __future__ import annotations

import pytest

from scoring.blocks import BlockHasher, BlockSizeError, chain_keys, lora_seed, root_key

TOKENS = list(range(100, 200))  # 6 full blocks of 16 + 4 tokens


def keys(tokens: list[int] = TOKENS, bs: int = 16, model: str = "m", **kw: str) -> list[int]:
    return BlockHasher(bs, model).keys(tokens, **kw)


def test_only_full_blocks_get_a_key() -> None:
    assert len(keys()) == 6
    assert keys() == keys(TOKENS[:96])  # the 4 trailing tokens are not hashed
    assert keys(TOKENS[:15]) == []
    assert keys([]) == []


def test_keys_are_unsigned_64_bit_ints() -> None:
    assert all(isinstance(k, int) and 0 <= k < 2**64 for k in keys())


def test_keys_are_stable_across_processes_and_versions() -> None:
    # pinned: replicas sharing a Redis index and restarted routers must agree
    assert BlockHasher(16, "m").keys(list(range(40))) == [
        12065556531613786554,
        10235950729819165399,
    ]
    assert BlockHasher(16, "m").keys(list(range(40)), lora="ad", cache_salt="s") == [
        2030384063148196402,
        93028423136112835,
    ]


def test_a_key_depends_on_every_token_before_it() -> None:
    changed = [*TOKENS[:40], 7, *TOKENS[41:]]  # a token of block 2
    a, b = keys(), keys(changed)
    assert a[:2] == b[:2]
    assert all(x != y for x, y in zip(a[2:], b[2:], strict=True))


def test_the_model_name_seeds_the_root() -> None:
    assert root_key("m") != root_key("n")
    assert all(x != y for x, y in zip(keys(model="m"), keys(model="n"), strict=True))


def test_a_lora_adapter_changes_every_block() -> None:
    base, ad = keys(), keys(lora="ad")
    assert all(x != y for x, y in zip(base, ad, strict=True))
    assert keys(lora="ad") != keys(lora="other")
    assert lora_seed(None) == lora_seed("") == 0


def test_the_lora_seed_applies_to_blocks_after_the_first_too() -> None:
    # same parent, same tokens, different adapter -> a different key for block 1
    k0 = keys(lora="ad")[0]
    assert chain_keys(TOKENS[16:32], 16, parent=k0, lora="ad") != chain_keys(
        TOKENS[16:32], 16, parent=k0
    )


def test_the_cache_salt_is_folded_into_block_zero_only() -> None:
    salted = keys(cache_salt="tenant-1")
    assert salted[0] != keys()[0]
    assert salted != keys(cache_salt="tenant-2")
    # later blocks chain from the salted key 0 with no salt of their own
    assert salted[1:] == chain_keys(TOKENS[16:96], 16, parent=salted[0])


def test_a_chain_can_be_continued_from_any_block() -> None:
    whole = keys()
    head = chain_keys(TOKENS[:32], 16, parent=root_key("m"))
    tail = chain_keys(TOKENS[32:], 16, parent=head[-1])
    assert head + tail == whole


def test_extend_hashes_only_the_new_turn_and_matches_a_full_hash() -> None:
    h = BlockHasher(16, "m")
    first = h.keys(TOKENS[:40])
    assert h.extend(first, TOKENS) == h.keys(TOKENS)
    assert h.extend([], TOKENS, cache_salt="s") == h.keys(TOKENS, cache_salt="s")
    assert h.extend(h.keys(TOKENS[:40], lora="a"), TOKENS, lora="a") == h.keys(TOKENS, lora="a")


def test_block_size_changes_the_chain() -> None:
    assert len(keys(bs=32)) == 3
    assert keys(bs=32)[0] not in keys(bs=16)


@pytest.mark.parametrize("bs", [0, -16])
def test_a_non_positive_block_size_is_rejected(bs: int) -> None:
    with pytest.raises(BlockSizeError, match="block_size must be positive"):
        BlockHasher(bs)
    with pytest.raises(BlockSizeError):
        chain_keys(TOKENS, bs, parent=0)


@pytest.mark.parametrize("bad", [[-1] * 16, [2**32] * 16, [1.5] * 16, ["a"] * 16])
def test_token_ids_outside_uint32_are_rejected_with_a_clear_error(bad: list[object]) -> None:
    with pytest.raises(ValueError, match="token ids must be integers"):
        chain_keys(bad, 16, parent=0)  # type: ignore[arg-type]


def test_the_largest_token_id_is_accepted() -> None:
    assert len(chain_keys([2**32 - 1] * 16, 16, parent=0)) == 1
