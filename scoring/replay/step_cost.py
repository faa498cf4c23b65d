"""How long one engine step takes, from what the step computes.

One vLLM engine step runs one forward pass over every token scheduled in it (decodes
and prefill chunks together).  Its cost, in seconds::

    step_s = base_s                                    # t0: once per step
           + prefill_token_s        * prefill_tokens   # a: linear layers per prompt token
           + prefill_pair_s         * prefill_pairs    # e: prefill attention
           + decode_seq_s           * decode_seqs      # b: linear layers per decode token
           + decode_context_token_s * decode_context   # c: decode attention (KV reads)

* ``prefill_tokens`` — prompt tokens computed in the step (chunks of prefilling
  requests, and the recompute of preempted ones).
* ``prefill_pairs`` — (query, key) pairs the prefill chunks attend: a chunk of ``n``
  tokens after ``p`` computed ones attends ``n * p + n * (n + 1) / 2`` pairs.  This
  makes a long prompt's cost grow quadratically, as causal attention does.
* ``decode_seqs`` — requests decoding one token in the step.
* ``decode_context`` — tokens those decodes attend (each one's computed tokens + 1),
  i.e. the KV cache a decode step reads.

Why this form: each term is one kind of work a step does, and the sum is *linear in
its parameters*, so ``calibrate`` can fit them by least squares to measured
(work, step seconds) samples (:data:`FEATURES` / :func:`features` are the design row).
``base_s`` is the per-step floor: streaming the weights once from HBM (a decode step of
a small batch is memory bound) plus launch and scheduling overhead.  A roofline model
would take ``max(weight streaming, linear FLOPs)`` instead of their sum; the linear form
overstates a large step by at most ``base_s`` (2% of an 8K-token chunk on the GPU
presets), and fits by least squares.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: names of the work terms, in the order of :func:`features` (the constant first)
FEATURES = ("step", "prefill_tokens", "prefill_pairs", "decode_seqs", "decode_context")


@dataclass(frozen=True, slots=True)
class StepWork:
    """What one engine step computes."""

    prefill_tokens: int = 0
    prefill_pairs: int = 0
    decode_seqs: int = 0
    decode_context: int = 0


def prefill_pairs(computed: int, chunk: int) -> int:
    """(query, key) pairs a prefill chunk of ``chunk`` tokens attends after ``computed``."""
    return chunk * computed + chunk * (chunk + 1) // 2


def features(work: StepWork) -> tuple[float, ...]:
    """The design row of ``work`` for fitting :class:`StepCost` (order: :data:`FEATURES`)."""
    return (
        1.0,
        float(work.prefill_tokens),
        float(work.prefill_pairs),
        float(work.decode_seqs),
        float(work.decode_context),
    )


#: the parameters of :class:`StepCost`, one per entry of :data:`FEATURES`
PARAMS = ("base_s", "prefill_token_s", "prefill_pair_s", "decode_seq_s", "decode_context_token_s")


class StepCostError(ValueError):
    """A step-cost parameter is invalid; the message names it."""


@dataclass(frozen=True, slots=True)
class StepCost:
    """Parameters of the step-time model (seconds per unit of work)."""

    base_s: float
    prefill_token_s: float
    prefill_pair_s: float
    decode_seq_s: float
    decode_context_token_s: float

    def validate(self) -> StepCost:
        for name in PARAMS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise StepCostError(f"{name} must be a number, got {v!r}")
            if not (math.isfinite(v) and v >= 0):
                raise StepCostError(f"{name} must be a finite number >= 0, got {v!r}")
        if self.base_s + self.prefill_token_s + self.decode_seq_s <= 0:
            raise StepCostError("a step must take time: base_s, prefill_token_s or decode_seq_s")
        return self

    def scaled(self, factor: float) -> StepCost:
        """Every step ``factor`` times as long (a pod ``1 / factor`` times as fast)."""
        return StepCost(*(getattr(self, name) * factor for name in PARAMS))

    def seconds(self, work: StepWork) -> float:
        return (
            self.base_s
            + self.prefill_token_s * work.prefill_tokens
            + self.prefill_pair_s * work.prefill_pairs
            + self.decode_seq_s * work.decode_seqs
            + self.decode_context_token_s * work.decode_context
        )

    def decode_run_s(self, seqs: int, context: int, steps: int) -> float:
        """Seconds of ``steps`` decode-only steps of ``seqs`` sequences whose first step
        attends ``context`` tokens (each step attends ``seqs`` more than the previous)."""
        per_step = self.base_s + self.decode_seq_s * seqs + self.decode_context_token_s * context
        growth = self.decode_context_token_s * seqs
        return steps * per_step + growth * steps * (steps - 1) / 2

    def decode_steps_within(self, seqs: int, context: int, span_s: float, cap: int) -> int:
        """The most decode-only steps (at most ``cap``) that end within ``span_s``."""
        if cap <= 0 or self.decode_run_s(seqs, context, 1) > span_s:
            return 0
        if self.decode_run_s(seqs, context, cap) <= span_s:
            return cap
        lo, hi = 1, cap  # run(lo) <= span < run(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.decode_run_s(seqs, context, mid) <= span_s:
                lo = mid
            else:
                hi = mid
        return lo
