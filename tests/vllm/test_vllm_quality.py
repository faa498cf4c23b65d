"""Live: the default policy's prefix-cache hit rate on two real vLLM CPU engines, against
the oracle placement.

Opt-in (``pytest -m vllm tests/vllm/test_vllm_quality.py``).  Workload: 9 conversations
x 4 turns over 3 system prompts, sent round by round (turn 1 of every conversation,
then turn 2, ...), one request at a time, through the ``kvroute`` router (policy
``cost``).  The oracle sends conversation ``i`` straight to engine ``i % 2``.  The hit
rate is the engines' own ``vllm:prefix_cache_hits_total`` /
``vllm:prefix_cache_queries_total`` over the run, summed over both engines.

Sizes (tokens; block 32): system prompt 256, each user turn 64, each assistant turn 192
(the conversation's scripted answer, not the model's), ``max_tokens`` 1.  A
conversation's last prompt is 34 blocks.  Each engine's cache is
``--num-gpu-blocks-override 160``: the 9 conversations' working set (3 system prompts +
9 x 26 conversation blocks = 258 blocks) is larger than one cache and fits two; the
oracle's fuller engine needs 154.

Two starting states, each run from the same one (``POST /reset_prefix_cache`` on both
engines, then a fresh router): clean caches, and engine 1's cache first filled with
unrelated prompts sent directly to it (the normal state of a production pod: full of
old blocks no running request holds).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer

from tests.vllm.conftest import EngineFactory
from tests.vllm.test_vllm_routing import _metric, _pods, running_router
from tools.capture_vllm_events import VLLM_ROOT, EngineProcess

pytestmark = pytest.mark.vllm

MODEL = "tiny-llama"
BLOCK = 32
CAPACITY_BLOCKS = 160
CONVERSATIONS = 9
TURNS = 4
SYSTEM_PROMPTS = 3
SYSTEM_TOKENS, USER_TOKENS, ANSWER_TOKENS = 256, 64, 192
FILL_PROMPTS, FILL_TOKENS = 5, 1280  # 200 blocks of old cache: more than the whole cache
#: the target: the router's hit rate as a share of the oracle's
TARGET = 0.9

Messages = list[dict[str, str]]


def _text(tok: Tokenizer, tag: str, tokens: int) -> str:
    """Distinct words tagged ``tag``, about ``tokens`` tokens long."""
    words: list[str] = []
    while len(tok.encode(" ".join(words), add_special_tokens=False).ids) < tokens:
        words.extend(f"{tag}w{len(words) + i}" for i in range(8))
    return " ".join(words)


def conversations(tok: Tokenizer) -> list[list[Messages]]:
    """``[conversation][turn]`` -> the messages of that turn's request."""
    systems = [_text(tok, f"sys{s}", SYSTEM_TOKENS) for s in range(SYSTEM_PROMPTS)]
    out: list[list[Messages]] = []
    for c in range(CONVERSATIONS):
        history: Messages = [{"role": "system", "content": systems[c % SYSTEM_PROMPTS]}]
        turns: list[Messages] = []
        for t in range(TURNS):
            history.append({"role": "user", "content": _text(tok, f"c{c}u{t}", USER_TOKENS)})
            turns.append(list(history))
            history.append({"role": "assistant", "content": _text(tok, f"c{c}a{t}", ANSWER_TOKENS)})
        out.append(turns)
    return out


async def _counters(engines: list[EngineProcess]) -> tuple[float, float]:
    hits = queries = 0.0
    async with httpx.AsyncClient(timeout=10) as c:
        for e in engines:
            text = (await c.get(e.base_url + "/metrics")).text
            hits += _metric(text, "vllm:prefix_cache_hits_total")
            queries += _metric(text, "vllm:prefix_cache_queries_total")
    return hits, queries


async def _reset(engines: list[EngineProcess], fill: bool, tok: Tokenizer) -> None:
    """Empty both caches; with ``fill``, fill engine 1's with unrelated prompts."""
    async with httpx.AsyncClient(timeout=120) as c:
        for e in engines:
            (await c.post(e.base_url + "/reset_prefix_cache")).raise_for_status()
        if fill:
            for i in range(FILL_PROMPTS):
                body = {
                    "model": MODEL,
                    "prompt": _text(tok, f"old{i}", FILL_TOKENS),
                    "max_tokens": 1,
                }
                (
                    await c.post(engines[1].base_url + "/v1/completions", json=body)
                ).raise_for_status()


Send = Callable[[int, Messages], Awaitable[None]]


async def _run(engines: list[EngineProcess], convs: list[list[Messages]], send: Send) -> float:
    """Play the workload round by round; the engines' hit rate over it."""
    h0, q0 = await _counters(engines)
    for t in range(TURNS):
        for c, turns in enumerate(convs):
            await send(c, turns[t])
    h1, q1 = await _counters(engines)
    return (h1 - h0) / (q1 - q0)


def _body(messages: Messages) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": 1, "temperature": 0}


async def oracle_hit_rate(
    engines: list[EngineProcess], convs: list[list[Messages]], tok: Tokenizer, fill: bool
) -> float:
    await _reset(engines, fill, tok)
    async with httpx.AsyncClient(timeout=120) as c:

        async def send(conv: int, messages: Messages) -> None:
            url = engines[conv % 2].base_url + "/v1/chat/completions"
            (await c.post(url, json=_body(messages))).raise_for_status()

        return await _run(engines, convs, send)


async def router_hit_rate(
    engines: list[EngineProcess],
    convs: list[list[Messages]],
    tok: Tokenizer,
    fill: bool,
    policy_params: dict[str, Any],
) -> tuple[float, list[str]]:
    """The router's hit rate and, per conversation, the engines its turns went to."""
    placed: list[list[str]] = [[] for _ in convs]
    async with running_router(_pods(engines), policy_params=policy_params) as router:
        await _reset(engines, fill, tok)
        await _until_the_router_sees(router, engines, fill)

        async def send(conv: int, messages: Messages) -> None:
            r = await router.post("/v1/chat/completions", json=_body(messages))
            assert r.status_code == 200, r.text
            placed[conv].append(r.headers["x-kvroute-pod"].removeprefix("vllm-"))

        rate = await _run(engines, convs, send)
    return rate, ["".join(p) for p in placed]


async def _until_the_router_sees(
    router: httpx.AsyncClient, engines: list[EngineProcess], fill: bool
) -> None:
    """Wait until the router knows both caches' sizes (scraped) and, with ``fill``, has
    indexed engine 1's old blocks (events) and read its usage."""
    deadline = time.monotonic() + 30
    probe = {"model": MODEL, "prompt": "probe"}
    while True:
        plan = (await router.post("/v1/route", json=probe)).json()
        cand = {c["pod"]: c for c in plan["candidates"]}
        sized = all(cand[f"vllm-{i}"].get("capacity_blocks") for i in range(len(engines)))
        resident = cand["vllm-1"].get("resident_blocks") or 0
        if sized and (not fill or resident >= CAPACITY_BLOCKS // 2):
            await asyncio.sleep(2.0)  # one more scrape: usage after the fill finished
            return
        assert time.monotonic() < deadline, f"the router never saw the engines: {plan}"
        await asyncio.sleep(0.3)


@pytest.fixture(scope="module")
def engines(engine: EngineFactory) -> list[EngineProcess]:
    return engine.many(["quality-0", "quality-1"], num_blocks=CAPACITY_BLOCKS)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(VLLM_ROOT / MODEL / "tokenizer.json"))


@pytest.fixture(scope="module")
def oracles() -> dict[bool, float]:
    """The oracle's hit rate per starting state, measured once per module."""
    return {}


@pytest.mark.parametrize(
    "policy_params",
    [{}, {"charge_hot_evictions": False}],
    ids=["defaults", "no-hot-eviction-charge"],
)
@pytest.mark.parametrize("fill", [False, True], ids=["clean", "one-engine-full-of-old-cache"])
async def test_the_router_reaches_nine_tenths_of_the_oracle_placements_hit_rate(
    engines: list[EngineProcess],
    tokenizer: Tokenizer,
    oracles: dict[bool, float],
    fill: bool,
    policy_params: dict[str, Any],
) -> None:
    convs = conversations(tokenizer)
    if fill not in oracles:
        oracles[fill] = await oracle_hit_rate(engines, convs, tokenizer, fill)
    oracle = oracles[fill]
    routed, placed = await router_hit_rate(engines, convs, tokenizer, fill, policy_params)
    print(
        f"\n{'filled' if fill else 'clean'} {policy_params}: router {routed:.3f} "
        f"oracle {oracle:.3f} ratio {routed / oracle:.3f} engines per turn {placed}"
    )
    assert oracle > 0.5, f"the oracle's hit rate {oracle:.3f}: the workload reuses nothing"
    assert routed >= TARGET * oracle, (
        f"router {routed:.3f} < {TARGET} x oracle {oracle:.3f}; engines per turn: {placed}"
    )
