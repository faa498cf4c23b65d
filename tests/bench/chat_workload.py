"""A seeded multi-turn chat workload, written once as a replay trace and sent live as is.

Used by ``bench_live_vs_replay.py`` so that ``kvroute replay`` and a live fleet get the
very same requests: the same bodies (token for token, once the shared tokenizer renders
them), at the same offsets from the start.

The load is **open loop**: every request has a fixed send time, decided by the seed, and
the client sends it then whether or not the conversation's previous turn has finished.
Each turn's history carries a fixed, seeded assistant answer (not the pod's output), so
turn k's prompt does not depend on what any pod generated.  That is what makes the live
requests identical to the trace's; it departs from a chat client (which waits for the
answer, then thinks) only when a turn takes longer than the think time.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx


@dataclass(frozen=True)
class ChatShape:
    """The workload's knobs (all token counts are words from the tokenizer's vocabulary,
    about one token each)."""

    conversations: int = 24
    turns: int = 8
    prefixes: int = 5
    prefix_words: int = 1000
    user_words: int = 200
    answer_words: int = 100
    think_s: float = 3.0
    ramp_s: float = 8.0
    max_tokens: int = 8


@dataclass(frozen=True)
class TimedRequest:
    at_s: float  # send time, seconds from the start
    session: str
    body: dict[str, Any]


def vocabulary(tokenizer_dir: Path) -> list[str]:
    """Whole-word entries of the tokenizer's BPE vocabulary (space-prefixed, letters only),
    sorted, so that a seeded choice of words is the same text on every machine."""
    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"]
    words = sorted(w[1:] for w in vocab if w.startswith("\u0120") and w[1:].isalpha())
    if len(words) < 100:
        raise ValueError(f"{tokenizer_dir}: too few word tokens ({len(words)}) to build text")
    return words


def _text(rnd: random.Random, words: list[str], n: int) -> str:
    return " ".join(rnd.choice(words) for _ in range(n))


def generate(shape: ChatShape, seed: int, words: list[str]) -> list[TimedRequest]:
    """Conversations start uniformly over ``ramp_s``; each opens with a system message
    (one of ``prefixes`` shared texts) and a user turn; turn k+1 is sent a think time
    (normal, mean ``think_s``, sd a quarter of it, at least a fifth) after turn k was
    sent, with turn k's seeded answer and a new user turn appended to the history."""
    rnd = random.Random(seed)
    systems = [_text(rnd, words, shape.prefix_words) for _ in range(shape.prefixes)]
    out: list[TimedRequest] = []
    for c in range(shape.conversations):
        session = f"s{seed}-c{c}"
        messages: list[dict[str, str]] = [{"role": "system", "content": rnd.choice(systems)}]
        at = rnd.uniform(0.0, shape.ramp_s)
        for _turn in range(shape.turns):
            messages.append({"role": "user", "content": _text(rnd, words, shape.user_words)})
            body = {
                "model": "sim-model",
                "messages": list(messages),
                "max_tokens": shape.max_tokens,
                "stream": True,
            }
            out.append(TimedRequest(round(at, 3), session, body))
            messages.append({"role": "assistant", "content": _text(rnd, words, shape.answer_words)})
            at += max(shape.think_s / 5, rnd.gauss(shape.think_s, shape.think_s / 4))
    out.sort(key=lambda r: (r.at_s, r.session))
    return out


def write_trace(reqs: list[TimedRequest], path: Path) -> Path:
    """The workload as a ``kvroute replay --format openai`` trace (timestamps in ms)."""
    with path.open("w") as f:
        for r in reqs:
            line = {"timestamp": r.at_s * 1000.0, "session_id": r.session, "body": r.body}
            f.write(json.dumps(line) + "\n")
    return path


@dataclass
class Sent:
    session: str
    ttft_s: float | None  # None: failed
    lag_s: float  # how late the client sent it (a loaded machine delays the event loop)
    status: int


async def _send_all(url: str, reqs: list[TimedRequest], timeout_s: float) -> list[Sent]:
    loop = asyncio.get_running_loop()
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(limits=limits, timeout=timeout_s) as client:
        t0 = loop.time() + 0.5

        async def one(r: TimedRequest) -> Sent:
            await asyncio.sleep(max(0.0, t0 + r.at_s - loop.time()))
            start = loop.time()
            lag = start - (t0 + r.at_s)
            try:
                async with client.stream("POST", url, json=r.body) as resp:
                    ttft = None
                    async for _chunk in resp.aiter_raw():
                        if ttft is None:
                            ttft = loop.time() - start
                    ok = resp.status_code == 200
                    return Sent(r.session, ttft if ok else None, lag, resp.status_code)
            except httpx.HTTPError:
                return Sent(r.session, None, lag, 0)

        return await asyncio.gather(*(one(r) for r in reqs))


def send_all(port: int, reqs: list[TimedRequest], timeout_s: float = 120.0) -> list[Sent]:
    """Send every request to ``127.0.0.1:port`` at its time (streaming chat) and time the
    first byte of each answer's body (the sim sends its first chunk with the first token)."""
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    return asyncio.run(_send_all(url, reqs, timeout_s))
