"""Benchmark: render chat template + tokenize + hash block keys, cold and multi-turn.

    python tests/bench/bench_tokenize.py [--model DIR] [--block-size 16] [--repeat 30]

Model: ``--model`` if given, else the engine's tiny model (/tmp/vllmcpu/tiny-llama) when
built, else the ChatML-with-tools test fixture (trained locally, small vocabulary: more
tokens per character than a production tokenizer, so a pessimistic case).

Rows:

* ``cold``: one request from scratch (no reuse): render, tokenize, hash — and each stage
  alone — for chats of about 1K / 8K / 32K tokens;
* ``new turn``: a conversation grown turn by turn (user question + assistant answer of
  about 100 tokens each) through ~32K tokens; each request reuses the previous turn via
  :class:`ChatEncoder`.  Ids are checked against a full encode for every sample;
* ``new conv, shared prefix``: new conversations (one short user message each) behind
  the same ~30K-token system prompt, which the encoder reuses across conversations.

Targets (issue 3): cold p50 <= 10 ms at 32K tokens; new turn <= 2 ms.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from router.tokenize.encoder import ChatEncoder
from router.tokenize.hf import HFTokenizer
from scoring.blocks import BlockHasher

TINY = Path("/tmp/vllmcpu/tiny-llama")

PARAGRAPHS = [
    "The router sends each request to the pod that already holds the longest prefix of "
    "the prompt in its key-value cache, before any offload tier is touched.",
    "def route(request, pods):\n    scores = {pod: score(pod, request) for pod in pods}\n"
    "    return min(scores, key=scores.get)\n",
    "Weather in Paris today: sunny, 21 degrees; in Berlin, rain and 14 degrees. Tomorrow "
    "brings wind from the west and scattered showers over the northern coast.",
    "Please summarise the following document in three sentences, keeping every number "
    "exactly as written: revenue grew 12.5% to $4.2B while costs fell 3%.",
]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def make_turn(i: int, words: int) -> tuple[dict[str, Any], dict[str, Any]]:
    text = " ".join(PARAGRAPHS[(i + j) % len(PARAGRAPHS)] for j in range(max(1, words // 25)))
    user = {"role": "user", "content": f"Turn {i}. {text[: words * 3]}"}
    assistant = {"role": "assistant", "content": f"Answer {i}: " + text[: words * 2]}
    return user, assistant


def chat_of(tok: HFTokenizer, target_tokens: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a helpful assistant."}]
    i = 0
    while True:
        user, assistant = make_turn(i, 400)
        candidate = [*messages, user]
        if len(tok.encode_chat(candidate)) >= target_tokens:
            return candidate
        messages = [*candidate, assistant]
        i += 1


def time_ms(fn: Any, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1000)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model directory (tokenizer.json + chat template)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args(argv)

    if args.model:
        model_dir = Path(args.model)
    elif (TINY / "tokenizer.json").is_file():
        model_dir = TINY
    else:
        from tests.fixtures.tokenizers.build import fixture_dirs

        model_dir = fixture_dirs()["chatml"]
    tok = HFTokenizer.from_dir(model_dir)
    hasher = BlockHasher(args.block_size, model="bench")
    print(f"model: {model_dir}  block_size: {args.block_size}  repeat: {args.repeat}")
    gc.disable()

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"load average (1 min) at start: {load:.2f} on {os.cpu_count()} cores")
    header = f"{'case':<26}{'tokens':>8}{'min ms':>10}{'p50 ms':>10}{'p99 ms':>10}"
    print(header)
    print("-" * len(header))
    for target in (1_000, 8_000, 32_000):
        messages = chat_of(tok, target)
        text = tok.render_chat(messages)
        ids = tok.encode_text(text, add_special_tokens=False)
        cold = ChatEncoder(tok, hasher, max_entries=0)
        rows = {
            "cold render+tok+hash": time_ms(
                lambda m=messages, c=cold: c.encode_chat(m), args.repeat
            ),
            "  render only": time_ms(lambda m=messages: tok.render_chat(m), args.repeat),
            "  tokenize only": time_ms(
                lambda t=text: tok.encode_text(t, add_special_tokens=False), args.repeat
            ),
            "  tokenize, 1 thread": time_ms(
                lambda t=text: tok.tokenizer.encode(t, add_special_tokens=False).ids, args.repeat
            ),
            "  hash only": time_ms(lambda i=ids: hasher.keys(i), args.repeat),
        }
        for name, times in rows.items():
            print(
                f"{name:<26}{len(ids):>8}{min(times):>10.2f}"
                f"{statistics.median(times):>10.2f}{pct(times, 0.99):>10.2f}"
            )
        gc.collect()

    # multi-turn: grow to ~32K tokens, time each new turn with reuse
    encoder = ChatEncoder(tok, hasher)
    messages = chat_of(tok, 29_000)
    encoder.encode_chat(messages)
    samples: list[float] = []
    sizes: list[int] = []
    reused: list[int] = []
    i = 10_000
    while len(samples) < args.repeat:
        user, assistant = make_turn(i, 60)
        messages = [*messages, {"role": "assistant", "content": assistant["content"]}, user]
        t0 = time.perf_counter()
        got = encoder.encode_chat(messages)
        samples.append((time.perf_counter() - t0) * 1000)
        exact = tok.encode_chat(messages)
        if got.token_ids != exact or got.block_keys != hasher.keys(exact):
            print("ERROR: reuse diverged from a full encode", file=sys.stderr)
            return 1
        sizes.append(len(exact))
        reused.append(got.reused_tokens)
        i += 1
    print(
        f"{'new turn (reuse)':<26}{statistics.median(sizes):>8.0f}{min(samples):>10.2f}"
        f"{statistics.median(samples):>10.2f}{pct(samples, 0.99):>10.2f}"
    )
    # new conversations that share a long system prompt (agent instructions + tools)
    shared = ChatEncoder(tok, hasher)
    system_text = "\n".join(
        f"Rule {i}: " + PARAGRAPHS[i % len(PARAGRAPHS)] for i in range(1, 100_000)
    )
    lo, hi = 0, len(system_text)
    while hi - lo > 200:  # a system prompt of about 30K tokens
        mid = (lo + hi) // 2
        n = len(tok.encode_text(system_text[:mid], add_special_tokens=False))
        lo, hi = (mid, hi) if n < 30_000 else (lo, mid)
    system = {"role": "system", "content": system_text[:lo]}
    shared.encode_chat([system, {"role": "user", "content": "warm-up question"}])
    conv_samples: list[float] = []
    conv_sizes: list[int] = []
    for j in range(args.repeat):
        request = [system, {"role": "user", "content": f"User {j} asks about item {j * 13}."}]
        t0 = time.perf_counter()
        got = shared.encode_chat(request)
        conv_samples.append((time.perf_counter() - t0) * 1000)
        if got.token_ids != tok.encode_chat(request):
            print("ERROR: shared-prefix reuse diverged from a full encode", file=sys.stderr)
            return 1
        conv_sizes.append(len(got.token_ids))
    print(
        f"{'new conv, shared prefix':<26}{statistics.median(conv_sizes):>8.0f}"
        f"{min(conv_samples):>10.2f}{statistics.median(conv_samples):>10.2f}"
        f"{pct(conv_samples, 0.99):>10.2f}"
    )
    new_tokens = [s - r for s, r in zip(sizes, reused, strict=True)]
    print(
        f"\nnew turn: {min(sizes)}-{max(sizes)} tokens per request, "
        f"median {statistics.median(new_tokens):.0f} tokens tokenized, "
        f"rest reused; ids and keys identical to a full encode in all {len(samples)} samples"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
