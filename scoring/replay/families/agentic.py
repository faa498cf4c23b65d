"""Agentic coding sessions: long tool loops over one growing context.

A session starts with one of a few shared system prompts (instructions + tool schemas,
shared across sessions) and a task.  Each step's prompt is the previous prompt plus the
model's output plus the next input — a tool result, or now and then a human message —
so nearly all of a prompt was already in the previous one.  When the context would pass
``compact_fraction`` of the context window, the agent *compacts*: one request asks for
a summary of the whole context, and the session continues from the system prompt plus
that summary (a new, shorter prefix: the old chain is never reused).  Steps are
separated by think time (tool execution + the agent's own overhead), and by a longer
human gap before a human message.  The trace is the steady window of the sessions
(:func:`~scoring.replay.families.build.steady_window`).

Defaults and where they come from (never fitted to a policy's result):

* ~84 model calls per session, ~96% of input tokens cache reads, ~520 output tokens a
  call: TraceLab (arXiv:2606.30560; 4,265 Claude Code / Codex sessions, 357,161 steps,
  54.9 B input, 52.6 B cached-read and 186.9 M output tokens).  Its steps per session
  are heavy-tailed (median ~16, mean 82, p99 > 1,000); ``turns_median = 40`` with
  ``turns_sigma = 0.6`` (mean ~48, p90 ~87) sits between its median and mean, giving
  "tens of turns" without the tail that would let two or three sessions make up a
  trace of a few thousand requests.
* 11% of steps start from a human message (TraceLab: 8.9 user- vs 73.6 tool-initiated
  steps per session), after a human gap of median 60 s (an assumption).
* ~8.5 s between calls: LMCache's Claude Code trace of one SWE-bench task (92 calls in
  13 minutes, ~2 M input tokens, 92% prefix reuse;
  huggingface.co/blog/kobe0938/context-engineering-reuse-pattern-claude-code):
  ``think_s_median = 6`` with ``think_sigma = 0.85`` has mean 8.6 s.
* Tool results of median 800 tokens (mean ~1.6 K) and outputs of median 300 (mean ~500):
  with the ~22 K mean context of that trace, ~2 K new tokens a step is its 92% reuse.
* An 8 K-token system prompt and a 64 K context window compacted at 80%: assumptions
  (a coding agent's instructions + tool schemas are several thousand tokens; 64 K is a
  common served context length), scaled down from frontier agents' 200 K windows so a
  trace of thousands of requests replays in seconds.
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
class AgenticParams:
    sessions: int = 120
    #: session starts (the offered-load scaling rescales all times); with the default
    #: durations ~25 sessions are in flight at once
    arrivals: Arrivals = field(default_factory=lambda: Poisson(rate_per_s=1 / 30))
    turns_median: float = 40.0
    turns_sigma: float = 0.6
    turns_min: int = 10
    turns_max: int = 150
    system_prompts: int = 3
    system_prompt_zipf: float = 0.0  # 0 = each session picks one uniformly
    system_prompt_tokens: int = 8000
    task_tokens_median: float = 2000.0
    task_sigma: float = 1.0
    tool_tokens_median: float = 800.0
    tool_sigma: float = 1.2
    tool_tokens_max: int = 32_768
    user_tokens_median: float = 100.0
    user_sigma: float = 1.0
    human_turn_share: float = 0.11
    output_tokens_median: float = 300.0
    output_sigma: float = 1.0
    output_tokens_max: int = 4096
    think_s_median: float = 6.0
    think_sigma: float = 0.85
    human_think_s_median: float = 60.0
    human_think_sigma: float = 1.0
    context_window_tokens: int = 65_536
    compact_fraction: float = 0.8
    compaction_prompt_tokens: int = 200
    summary_tokens_median: float = 3000.0
    summary_sigma: float = 0.3
    #: keep the steady window after this quantile of session durations (see .build)
    warmup_quantile: float = 0.9
    block_size: int = 16

    def validate(self) -> AgenticParams:
        if self.sessions < 1 or self.system_prompts < 1 or self.block_size < 1:
            raise ValueError("sessions, system_prompts and block_size must be >= 1")
        if not 1 <= self.turns_min <= self.turns_max:
            raise ValueError(f"need 1 <= turns_min <= turns_max, got {self}")
        if not 0.0 <= self.human_turn_share <= 1.0:
            raise ValueError(f"human_turn_share must be in [0, 1], got {self.human_turn_share}")
        if not 0.0 < self.compact_fraction <= 1.0:
            raise ValueError(f"compact_fraction must be in (0, 1], got {self.compact_fraction}")
        return self


def generate(p: AgenticParams, seed: int) -> Trace:
    """The steady window of ``p.sessions`` agent sessions, deterministic for ``seed``."""
    p.validate()
    rng = random.Random(f"agentic:{seed}")
    ids = SegmentIds()
    b = TraceBuilder("agentic", p.block_size)
    systems = [ids.new() for _ in range(p.system_prompts)]
    weights = zipf_weights(p.system_prompts, p.system_prompt_zipf)
    compaction_instruction = ids.new()  # the same instruction text in every session
    compact_at = p.compact_fraction * p.context_window_tokens
    spans: list[tuple[float, float]] = []
    for s, start in enumerate(p.arrivals.times(p.sessions, rng)):
        system = rng.choices(systems, weights)[0]
        session = f"agent-{s}"
        ctx = b.context().append(system, p.system_prompt_tokens)
        ctx.append(ids.new(), lognormal_int(rng, p.task_tokens_median, p.task_sigma, 1, 32_768))
        turns = lognormal_int(rng, p.turns_median, p.turns_sigma, p.turns_min, p.turns_max)
        t = start
        step = 0
        for turn in range(turns):
            out = lognormal_int(rng, p.output_tokens_median, p.output_sigma, 1, p.output_tokens_max)
            step += 1
            b.add(t, ctx, out, session=session, turns=step)
            if turn == turns - 1:
                break
            ctx.append(ids.new(), out)  # the model's reply is part of the next prompt
            human = rng.random() < p.human_turn_share
            if human:
                new = lognormal_int(rng, p.user_tokens_median, p.user_sigma, 1, 32_768)
                t += lognormal_s(rng, p.human_think_s_median, p.human_think_sigma)
            else:
                new = lognormal_int(rng, p.tool_tokens_median, p.tool_sigma, 1, p.tool_tokens_max)
                t += lognormal_s(rng, p.think_s_median, p.think_sigma)
            if ctx.tokens + new > compact_at:
                ctx.append(compaction_instruction, p.compaction_prompt_tokens)
                summary = lognormal_int(rng, p.summary_tokens_median, p.summary_sigma, 256, 8192)
                step += 1
                b.add(t, ctx, summary, session=session, turns=step)
                # the summary replaces the history: a new chain after the system prompt
                ctx = b.context().append(system, p.system_prompt_tokens)
                ctx.append(ids.new(), summary)
                t += lognormal_s(rng, p.think_s_median, p.think_sigma)
            ctx.append(ids.new(), new)
        spans.append((start, t))
    return b.build(steady_window(spans, p.warmup_quantile))
