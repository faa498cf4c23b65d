"""Mixed long and short prompts: mostly chat-sized requests, some document-sized ones.

Every request starts with one of a few shared system prompts and continues with text no
other request has, so reuse is low and uneven request sizes make balance the problem: a
long prompt holds a pod's prefill for seconds while short ones queue behind it.

Defaults and where they come from (never fitted to a policy's result):

* long prompts of median 12,000 tokens: the Mooncake conversation trace's mean input
  (12,035 tokens, ../shared/traces/README.md); 20% of requests.
* short prompts of median 400 tokens: an assumption (a chat turn with some history).
* outputs of median 155 tokens (mean ~215, LMSYS-Chat-1M, arXiv:2309.11998).
* 3 shared 500-token system prompts: an assumption.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from scoring.replay.families.arrivals import Arrivals, Poisson
from scoring.replay.families.build import TraceBuilder
from scoring.replay.families.context import SegmentIds, lognormal_int
from scoring.replay.trace import Trace


@dataclass(frozen=True)
class MixedParams:
    requests: int = 1500
    arrivals: Arrivals = field(default_factory=lambda: Poisson(rate_per_s=1.0))
    long_share: float = 0.2
    long_tokens_median: float = 12_000.0
    long_sigma: float = 0.5
    short_tokens_median: float = 400.0
    short_sigma: float = 0.8
    system_prompts: int = 3
    system_prompt_tokens: int = 500
    output_tokens_median: float = 155.0
    output_sigma: float = 0.8
    output_tokens_max: int = 4096
    block_size: int = 16

    def validate(self) -> MixedParams:
        if self.requests < 1 or self.system_prompts < 1 or self.block_size < 1:
            raise ValueError("requests, system_prompts and block_size must be >= 1")
        if not 0.0 <= self.long_share <= 1.0:
            raise ValueError(f"long_share must be in [0, 1], got {self.long_share}")
        return self


def generate(p: MixedParams, seed: int) -> Trace:
    """``p.requests`` requests, ``long_share`` of them long, deterministic for ``seed``."""
    p.validate()
    rng = random.Random(f"mixed:{seed}")
    ids = SegmentIds()
    b = TraceBuilder("mixed", p.block_size)
    systems = [ids.new() for _ in range(p.system_prompts)]
    for t in p.arrivals.times(p.requests, rng):
        ctx = b.context().append(rng.choice(systems), p.system_prompt_tokens)
        if rng.random() < p.long_share:
            body = lognormal_int(rng, p.long_tokens_median, p.long_sigma, 4096, 131_072)
        else:
            body = lognormal_int(rng, p.short_tokens_median, p.short_sigma, 1, 4095)
        ctx.append(ids.new(), body)
        out = lognormal_int(rng, p.output_tokens_median, p.output_sigma, 1, p.output_tokens_max)
        b.add(t, ctx, out)
    return b.build()
