"""ChatEncoder: ids + block keys, reusing the previous turn without changing a single id."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path
from typing import Any

import pytest

from router.tokenize import ApproxTokenizer, ByteTokenizer, ChatEncoder, TokenizeError
from router.tokenize.encoder import common_prefix_len
from router.tokenize.hf import HFTokenizer
from scoring.blocks import BlockHasher
from tests.fixtures.tokenizers.build import fixture_dirs

TEMPLATES = ["chatml", "llama3", "zephyr"]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


@pytest.fixture(scope="module")
def toks() -> dict[str, HFTokenizer]:
    return {name: HFTokenizer.from_dir(path) for name, path in fixture_dirs().items()}


def conversation_turns(
    n_turns: int, *, system: str = "You are a careful assistant."
) -> list[list[dict[str, Any]]]:
    """The message list of each request of one growing multi-turn chat."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    requests = []
    for i in range(n_turns):
        messages = [
            *messages,
            {"role": "user", "content": f"Question {i}: what about item {i * 7}?"},
        ]
        requests.append(copy.deepcopy(messages))
        messages = [
            *messages,
            {"role": "assistant", "content": f"Answer {i}: item {i * 7} is fine. " * (i % 3 + 1)},
        ]
    return requests


def full_encode(
    tok: HFTokenizer, hasher: BlockHasher, messages: list[dict[str, Any]], **kw: Any
) -> tuple[list[int], list[int]]:
    lora = kw.pop("lora", None)
    salt = kw.pop("cache_salt", None)
    ids = tok.encode_chat(messages, **kw)
    return ids, hasher.keys(ids, lora=lora, cache_salt=salt)


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("block_size", [4, 16])
def test_multi_turn_reuse_gives_the_same_ids_and_keys_as_a_full_encode(
    toks: dict[str, HFTokenizer], template: str, block_size: int
) -> None:
    tok = toks[template]
    hasher = BlockHasher(block_size, model="m")
    encoder = ChatEncoder(tok, hasher)
    for turn, messages in enumerate(conversation_turns(8)):
        got = encoder.encode_chat(messages)
        ids, keys = full_encode(tok, hasher, messages)
        assert got.token_ids == ids
        assert got.block_keys == keys
        assert not got.approximate
        if turn > 0:
            assert got.reused_tokens > 0, f"turn {turn} did not reuse the previous turn"
            assert got.reused_tokens < len(ids)
    assert encoder.stats.reuse_hits == 7


@pytest.mark.parametrize("template", ["chatml", "llama3"])
def test_reuse_with_tools_lora_and_cache_salt_matches_a_full_encode(
    toks: dict[str, HFTokenizer], template: str
) -> None:
    tok = toks[template]
    hasher = BlockHasher(8, model="m")
    encoder = ChatEncoder(tok, hasher)
    kw: dict[str, Any] = {"tools": TOOLS, "lora": "adapter-a", "cache_salt": "tenant-1"}
    for messages in conversation_turns(4):
        got = encoder.encode_chat(messages, **kw)
        ids, keys = full_encode(tok, hasher, messages, **kw)
        assert (got.token_ids, got.block_keys) == (ids, keys)
    assert encoder.stats.reuse_hits == 3


def test_edited_history_reuses_only_up_to_the_edit_and_stays_exact(
    toks: dict[str, HFTokenizer],
) -> None:
    tok = toks["chatml"]
    hasher = BlockHasher(4)
    encoder = ChatEncoder(tok, hasher)
    turns = conversation_turns(5)
    for messages in turns[:4]:
        encoder.encode_chat(messages)
    edited = copy.deepcopy(turns[4])
    edited[5]["content"] = "Question 2 was rewritten by the client."
    # same message prefix key for the first messages, different text from message 5 on
    got = encoder.encode_chat(edited)
    ids, keys = full_encode(tok, hasher, edited)
    assert (got.token_ids, got.block_keys) == (ids, keys)
    unchanged_text = tok.render_chat(edited[:5], add_generation_prompt=False)
    unchanged_tokens = len(tok.encode_text(unchanged_text, add_special_tokens=False))
    assert 0 < got.reused_tokens <= unchanged_tokens


def test_resending_the_same_request_reuses_everything(toks: dict[str, HFTokenizer]) -> None:
    encoder = ChatEncoder(toks["llama3"], BlockHasher(4))
    messages = conversation_turns(2)[-1]
    first = encoder.encode_chat(messages, chat_template_kwargs={"date_string": "1 Jan 2026"})
    again = encoder.encode_chat(messages, chat_template_kwargs={"date_string": "1 Jan 2026"})
    assert again.token_ids == first.token_ids and again.block_keys == first.block_keys
    assert again.reused_tokens == len(first.token_ids)


def test_different_cache_salt_never_reuses_another_salts_keys(toks: dict[str, HFTokenizer]) -> None:
    hasher = BlockHasher(4)
    encoder = ChatEncoder(toks["chatml"], hasher)
    turns = conversation_turns(2)
    encoder.encode_chat(turns[0], cache_salt="a")
    got = encoder.encode_chat(turns[1], cache_salt="b")
    assert got.reused_tokens == 0
    assert got.block_keys == full_encode(toks["chatml"], hasher, turns[1], cache_salt="b")[1]


def test_verify_every_catches_a_wrong_cut_and_switches_reuse_off(
    toks: dict[str, HFTokenizer],
) -> None:
    class ShiftedCuts(HFTokenizer):
        """A real tokenizer that reports every cut one character late (an unsafe boundary)."""

        def encode_with_cuts(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
            ids, cuts = super().encode_with_cuts(text)
            return ids, [(c + 1, k) for c, k in cuts]

    base = toks["chatml"]
    tok = ShiftedCuts(base.tokenizer, templates=base.templates, special_tokens=base.special_tokens)
    hasher = BlockHasher(4)
    encoder = ChatEncoder(tok, hasher, verify_every=1)
    turns = conversation_turns(3)
    results = [encoder.encode_chat(m) for m in turns]
    for messages, got in zip(turns, results, strict=True):
        assert got.token_ids == base.encode_chat(messages)  # the exact ids are still returned
    assert encoder.stats.verify_failures == 1
    assert encoder.reuse_enabled is False


def test_cache_is_bounded_by_entries_and_by_tokens(toks: dict[str, HFTokenizer]) -> None:
    encoder = ChatEncoder(toks["chatml"], BlockHasher(4), max_entries=3)
    for i in range(10):
        encoder.encode_chat([{"role": "user", "content": f"conversation {i}"}])
    assert encoder.cache_info()["entries"] == 3

    small = ChatEncoder(toks["chatml"], BlockHasher(4), max_cached_tokens=100)
    for i in range(10):
        small.encode_chat([{"role": "user", "content": f"conversation {i} " * 5}])
    info = small.cache_info()
    assert 0 < info["tokens"] <= 100
    assert info["entries"] < 10


def test_bad_input_is_rejected_and_the_encoder_keeps_working(toks: dict[str, HFTokenizer]) -> None:
    encoder = ChatEncoder(toks["chatml"], BlockHasher(4))
    for bad in ([], "text", [{"content": "no role"}], [{"role": "user", "content": {"x": 1}}]):
        with pytest.raises(TokenizeError):
            encoder.encode_chat(bad)  # type: ignore[arg-type]
    assert encoder.stats.errors == 4
    ok = encoder.encode_chat([{"role": "user", "content": "fine"}])
    assert ok.token_ids == toks["chatml"].encode_chat([{"role": "user", "content": "fine"}])


def test_completion_prompts_are_encoded_with_special_tokens_and_hashed(
    toks: dict[str, HFTokenizer],
) -> None:
    hasher = BlockHasher(2)
    encoder = ChatEncoder(toks["llama3"], hasher)
    got = encoder.encode_prompt("The router sends each request", lora="l")
    assert got.token_ids == toks["llama3"].encode_prompt("The router sends each request")
    assert got.block_keys == hasher.keys(got.token_ids, lora="l")


def test_async_encoding_matches_sync_inline_and_in_a_thread(toks: dict[str, HFTokenizer]) -> None:
    tok = toks["chatml"]
    hasher = BlockHasher(4)
    small = [{"role": "user", "content": "short"}]
    big = [{"role": "user", "content": "a long document line\n" * 2000}]

    async def run() -> None:
        encoder = ChatEncoder(tok, hasher, offload_chars=1000)
        for messages in (small, big):
            got = await encoder.aencode_chat(messages)
            assert got.token_ids == tok.encode_chat(messages)
        prompt = await encoder.aencode_prompt("x " * 3000)
        assert prompt.token_ids == tok.encode_prompt("x " * 3000)

    asyncio.run(run())


def test_builtin_tokenizer_works_through_the_encoder_without_reuse() -> None:
    encoder = ChatEncoder(ByteTokenizer(), BlockHasher(16))
    messages = [{"role": "user", "content": "hello"}]
    got = encoder.encode_chat(messages)
    assert got.token_ids == ByteTokenizer().encode_chat(messages)
    assert encoder.reuse_enabled is False and got.reused_tokens == 0


def test_approximate_tokenizer_is_flagged_and_shares_prefix_blocks() -> None:
    hasher = BlockHasher(4)
    encoder = ChatEncoder(ApproxTokenizer(4), hasher)
    system = {"role": "system", "content": "A shared system prompt that is long enough. " * 10}
    a = encoder.encode_chat([system, {"role": "user", "content": "first user"}])
    b = encoder.encode_chat([system, {"role": "user", "content": "another user entirely"}])
    assert a.approximate and b.approximate
    shared = 0
    while (
        shared < min(len(a.block_keys), len(b.block_keys))
        and a.block_keys[shared] == b.block_keys[shared]
    ):
        shared += 1
    # the ~470-char rendered system message is ~117 pseudo-tokens = 29 full blocks of 4
    assert shared >= 29
    assert a.block_keys[shared:] != b.block_keys[shared:]
    # deterministic across instances (other router replicas compute the same keys)
    again = ChatEncoder(ApproxTokenizer(4), hasher).encode_chat(
        [system, {"role": "user", "content": "first user"}]
    )
    assert again.block_keys == a.block_keys


def test_encoder_rejects_negative_settings(toks: dict[str, HFTokenizer]) -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        ChatEncoder(toks["chatml"], BlockHasher(4), max_entries=-1)


@pytest.mark.parametrize(
    ("a", "b", "n"),
    [
        ("", "", 0),
        ("abc", "abc", 3),
        ("abc", "abd", 2),
        ("x" * 1000 + "a", "x" * 1000 + "b", 1000),
        ("ab", "abc", 2),
    ],
)
def test_common_prefix_len(a: str, b: str, n: int) -> None:
    assert common_prefix_len(a, b) == n


def test_tiny_engine_model_reuse_is_exact_when_available() -> None:
    tiny = Path("/tmp/vllmcpu/tiny-llama")
    if not (tiny / "tokenizer.json").is_file():
        pytest.skip(f"{tiny} not built")
    tok = HFTokenizer.from_dir(tiny)
    hasher = BlockHasher(32)
    encoder = ChatEncoder(tok, hasher, verify_every=1)
    for messages in conversation_turns(6):
        got = encoder.encode_chat(messages)
        assert got.token_ids == tok.encode_chat(messages)
    assert encoder.stats.verify_failures == 0 and encoder.stats.reuse_hits == 5


@pytest.mark.parametrize("template", TEMPLATES)
def test_parallel_chunked_encoding_equals_one_sequential_encode(
    toks: dict[str, HFTokenizer], template: str
) -> None:
    base = toks[template]
    text = base.render_chat(conversation_turns(12)[-1], tools=None)
    sequential = HFTokenizer(
        base.tokenizer,
        templates=base.templates,
        special_tokens=base.special_tokens,
        parallel_chars=0,
    )
    chunked = HFTokenizer(
        base.tokenizer,
        templates=base.templates,
        special_tokens=base.special_tokens,
        parallel_chars=100,
        parallel_chunks=5,
    )
    assert len(chunked._split_points(text)) >= 4  # really split
    with_offsets = base.tokenizer.encode(text, add_special_tokens=False)
    exact = (with_offsets.ids, base._cuts_in(text, with_offsets, with_offsets.ids))
    assert exact[1], "the fixture text has cut points"
    assert chunked.encode_with_cuts(text) == exact
    assert sequential.encode_with_cuts(text) == exact


def test_tokens_another_added_token_can_overlap_are_never_split_points() -> None:
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    raw = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.add_special_tokens(
        [
            AddedToken("<|a|>", special=True),
            AddedToken("x<|a", special=True),
            AddedToken("<|b|>", special=True),
        ]
    )
    tok = HFTokenizer(raw)
    # "x<|a" runs into "<|a|>" (in "x<|a|>" the matcher takes "x<|a"): never split before it
    assert tok._find_split_tokens() == {"<|b|>", "x<|a"}
    text = "a x<|a|> a <|b|> a " * 50
    tok.parallel_chars, tok.parallel_chunks = 10, 8
    enc = raw.encode(text, add_special_tokens=False)
    by_offsets = tok._cuts_in(text, enc, enc.ids)
    assert (2, 1) in by_offsets  # "x<|a" matched at char 2, token 1 (not "<|a|>" at 3)
    assert tok._cuts_from_ids(text, enc.ids) == by_offsets
    assert tok.encode_with_cuts(text) == (enc.ids, by_offsets)


def test_an_occurrence_swallowed_by_a_non_cut_token_falls_back_to_offsets() -> None:
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    raw = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.add_special_tokens(
        [AddedToken("<|b|>", special=True), AddedToken("y<|b", special=True, lstrip=True)]
    )
    tok = HFTokenizer(raw)
    text = "a y<|b|> a <|b|> a " * 50
    enc = raw.encode(text, add_special_tokens=False)
    # the regex sees "<|b|>" inside "y<|b|>", where the tokenizer matched "y<|b"
    assert tok._cuts_from_ids(text, enc.ids) is None
    tok.parallel_chars, tok.parallel_chunks = 10, 8
    assert tok._find_split_tokens() == set()  # "y<|b" overlaps "<|b|>": nothing to split at
    assert tok.encode_with_cuts(text) == (enc.ids, tok._cuts_in(text, enc, enc.ids))


@pytest.mark.parametrize("template", TEMPLATES)
def test_a_new_conversation_reuses_a_shared_system_prompt_and_stays_exact(
    toks: dict[str, HFTokenizer], template: str
) -> None:
    tok = toks[template]
    hasher = BlockHasher(4)
    encoder = ChatEncoder(tok, hasher)
    system = {"role": "system", "content": "Follow the house rules carefully. " * 40}
    encoder.encode_chat([system, {"role": "user", "content": "first user's question"}])
    other = [system, {"role": "user", "content": "a different user asks something else"}]
    got = encoder.encode_chat(other)
    ids, keys = full_encode(tok, hasher, other)
    assert (got.token_ids, got.block_keys) == (ids, keys)
    system_tokens = len(tok.encode_text(system["content"], add_special_tokens=False))
    assert got.reused_tokens >= system_tokens
