"""RAG: many short questions over a few long shared documents.

Each request is ``[system prompt][document][question]``: the instruction and the
document (a retrieved context, the same text for every request that retrieves it) are
shared prefixes, the question is new.  Documents are drawn by a Zipf popularity, so a
few are hot and the rest are warm.

Defaults and where they come from (never fitted to a policy's result):

* ~6,000-token shared prefixes: llm-d's precise-prefix benchmark (150 groups x 6,000-token
  shared prefixes, llm-d-kv-cache benchmarking/37-capacity) — ``doc_tokens_median``.
* ~70-token questions and ~215-token answers: LMSYS-Chat-1M (arXiv:2309.11998, Table 1:
  69.5 tokens per prompt, 214.5 per response) — the medians below put the means there.
* ``docs = 16`` ("a few" documents, issue #9), ``doc_zipf = 1.0`` (classic Zipf
  popularity) and a 200-token instruction: assumptions.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from scoring.replay.families.arrivals import Arrivals, Poisson
from scoring.replay.families.build import TraceBuilder
from scoring.replay.families.context import SegmentIds, lognormal_int, zipf_weights
from scoring.replay.trace import Trace


@dataclass(frozen=True)
class RagParams:
    requests: int = 1500
    arrivals: Arrivals = field(default_factory=lambda: Poisson(rate_per_s=2.0))
    docs: int = 16
    doc_zipf: float = 1.0
    doc_tokens_median: float = 6000.0
    doc_sigma: float = 0.3
    system_prompt_tokens: int = 200
    question_tokens_median: float = 50.0
    question_sigma: float = 0.8
    output_tokens_median: float = 155.0
    output_sigma: float = 0.8
    output_tokens_max: int = 4096
    block_size: int = 16

    def validate(self) -> RagParams:
        if self.requests < 1 or self.docs < 1 or self.block_size < 1:
            raise ValueError("requests, docs and block_size must be >= 1")
        return self


def generate(p: RagParams, seed: int) -> Trace:
    """``p.requests`` questions over ``p.docs`` documents, deterministic for ``seed``."""
    p.validate()
    rng = random.Random(f"rag:{seed}")
    ids = SegmentIds()
    b = TraceBuilder("rag", p.block_size)
    system = ids.new()
    docs = [
        (ids.new(), lognormal_int(rng, p.doc_tokens_median, p.doc_sigma, 256, 65_536))
        for _ in range(p.docs)
    ]
    weights = zipf_weights(p.docs, p.doc_zipf)
    rng.shuffle(docs)  # popularity rank independent of length
    for t in p.arrivals.times(p.requests, rng):
        doc, doc_tokens = rng.choices(docs, weights)[0]
        ctx = b.context().append(system, p.system_prompt_tokens).append(doc, doc_tokens)
        ctx.append(
            ids.new(), lognormal_int(rng, p.question_tokens_median, p.question_sigma, 1, 4096)
        )
        out = lognormal_int(rng, p.output_tokens_median, p.output_sigma, 1, p.output_tokens_max)
        b.add(t, ctx, out)
    return b.build()
