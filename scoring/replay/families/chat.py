"""Multi-turn chat with a few shared system prompts.

A conversation picks one of ``system_prompts`` shared system prompts; each turn's
prompt is the whole conversation so far (system prompt, every earlier user message and
reply) plus the new user message, so turn ``k`` reuses turn ``k-1``'s prompt and reply.
Turns are separated by the user's think time.  The trace is the steady window of the
conversations (:func:`~scoring.replay.families.build.steady_window`).

Defaults and where they come from (never fitted to a policy's result):

* 5 system prompts of 1,000 tokens, 10 turns on average: the multi-turn setup measured
  against the peers' routers in PEERS.md (aiperf ``--num-prefix-prompts 5
  --prefix-prompt-length 1000 --conversation-turn-mean 10``).  Real chat logs are shorter
  (LMSYS-Chat-1M: 2.0 turns per conversation).
* ~70-token user messages, ~215-token replies: LMSYS-Chat-1M (arXiv:2309.11998, Table 1).
* 20 s median think time between turns: an assumption (reading a reply, typing the next).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from scoring.replay.families.arrivals import Arrivals, Poisson
from scoring.replay.families.build import TraceBuilder, steady_window
from scoring.replay.families.context import (
    SegmentIds,
    lognormal_int,
    lognormal_s,
    zipf_weights,
)
from scoring.replay.trace import Trace


@dataclass(frozen=True)
class ChatParams:
    conversations: int = 400
    #: conversation starts (the offered-load scaling rescales all times); with the
    #: default durations ~100 conversations are open at once
    arrivals: Arrivals = field(default_factory=lambda: Poisson(rate_per_s=0.5))
    turns_median: float = 9.0
    turns_sigma: float = 0.5
    turns_max: int = 40
    system_prompts: int = 5
    system_prompt_zipf: float = 0.0
    system_prompt_tokens: int = 1000
    user_tokens_median: float = 50.0
    user_sigma: float = 0.8
    output_tokens_median: float = 155.0
    output_sigma: float = 0.8
    output_tokens_max: int = 4096
    think_s_median: float = 20.0
    think_sigma: float = 0.8
    #: keep the steady window after this quantile of conversation durations (see .build)
    warmup_quantile: float = 0.9
    block_size: int = 16

    def validate(self) -> ChatParams:
        if self.conversations < 1 or self.system_prompts < 1 or self.block_size < 1:
            raise ValueError("conversations, system_prompts and block_size must be >= 1")
        if self.turns_max < 1:
            raise ValueError(f"turns_max must be >= 1, got {self.turns_max}")
        return self


def generate(p: ChatParams, seed: int) -> Trace:
    """The steady window of ``p.conversations`` chats, deterministic for ``seed``."""
    p.validate()
    rng = random.Random(f"chat:{seed}")
    ids = SegmentIds()
    b = TraceBuilder("chat", p.block_size)
    systems = [ids.new() for _ in range(p.system_prompts)]
    weights = zipf_weights(p.system_prompts, p.system_prompt_zipf)
    spans: list[tuple[float, float]] = []
    for c, start in enumerate(p.arrivals.times(p.conversations, rng)):
        ctx = b.context().append(rng.choices(systems, weights)[0], p.system_prompt_tokens)
        turns = lognormal_int(rng, p.turns_median, p.turns_sigma, 1, p.turns_max)
        t = start
        for turn in range(turns):
            if turn:
                t += lognormal_s(rng, p.think_s_median, p.think_sigma)
            ctx.append(ids.new(), lognormal_int(rng, p.user_tokens_median, p.user_sigma, 1, 8192))
            out = lognormal_int(rng, p.output_tokens_median, p.output_sigma, 1, p.output_tokens_max)
            b.add(t, ctx, out, session=f"chat-{c}", turns=turn + 1)
            ctx.append(ids.new(), out)
        spans.append((start, t))
    return b.build(steady_window(spans, p.warmup_quantile))
