"""Prove at runtime that the router tokenizes like the engine, and say so loudly if not.

A local tokenizer can silently disagree with the engine (a different template file, a
transformers model class that rebuilds the pre-tokenizer in code, an engine started with
``--chat-template``).  Wrong ids mean wrong block keys and a 0% predicted hit rate, so
:func:`check_against_engine` sends a few sample chats and prompts to a pod's
``POST /tokenize`` and compares.  The gateway runs it when a pod first becomes healthy
and reports the result (log + metric); the sample set covers system prompts, multi-turn
chats, content parts, unicode, whitespace runs and completion prompts.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from router.tokenize.base import PromptTokenizer, TokenizeError
from router.tokenize.remote import RemoteTokenizer

log = logging.getLogger(__name__)

SAMPLE_CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hello there"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And Germany?  Ünïcödé 😀\ttabs\n\nnewlines  "},
    ],
    [
        {
            "role": "user",
            "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}],
        }
    ],
]
SAMPLE_PROMPTS = ["Hello there", " leading space and  double  spaces", "def f(x):\n\treturn x\n"]


@dataclass
class TokenizerCheck:
    """The outcome of :func:`check_against_engine`."""

    checked: int = 0
    mismatches: list[str] = field(default_factory=list)
    #: requests the engine or the local tokenizer could not tokenize (not counted as checked)
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.checked > 0 and not self.mismatches


def _first_difference(a: Sequence[int], b: Sequence[int]) -> str:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return f"first difference at token {i}: router {x} vs engine {y}"
    return f"lengths differ: router {len(a)} vs engine {len(b)} tokens"


async def check_against_engine(
    tokenizer: PromptTokenizer,
    engine: RemoteTokenizer,
    *,
    chats: Sequence[Sequence[Mapping[str, Any]]] = SAMPLE_CHATS,
    prompts: Sequence[str] = SAMPLE_PROMPTS,
) -> TokenizerCheck:
    """Compare ``tokenizer`` with ``engine``'s ``/tokenize`` on sample requests.

    Logs an ERROR naming the first difference when any sample disagrees.
    """
    result = TokenizerCheck()
    cases: list[tuple[str, Any, Any]] = []
    for i, chat in enumerate(chats):
        cases.append(
            (
                f"chat[{i}]",
                lambda c=chat: tokenizer.encode_chat(c),
                lambda c=chat: engine.aencode_chat(c),
            )
        )
    for i, prompt in enumerate(prompts):
        cases.append(
            (
                f"prompt[{i}]",
                lambda p=prompt: tokenizer.encode_prompt(p),
                lambda p=prompt: engine.aencode_prompt(p),
            )
        )
    for label, local, remote in cases:
        try:
            theirs = await remote()
            ours = local()
        except TokenizeError as exc:
            result.errors.append(f"{label}: {exc}")
            continue
        result.checked += 1
        if ours != theirs:
            result.mismatches.append(f"{label}: {_first_difference(ours, theirs)}")
    if result.mismatches:
        log.error(
            "tokenizer %s does NOT match the engine at %s (%d of %d samples differ: %s); "
            "predicted cache hits will be wrong: use the engine's tokenizer files or "
            "tokenizer=remote:",
            getattr(tokenizer, "name", "?"),
            engine.base_urls[0],
            len(result.mismatches),
            result.checked,
            "; ".join(result.mismatches[:3]),
        )
    return result
