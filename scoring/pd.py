"""Prefill/decode disaggregation: which decode pod, which prefill pod, and whether to split.

Pure decision logic (no network), shared by the live router and ``kvroute replay
--prefill-pods N --decode-pods M``.  The caller hands two lists of
:class:`~scoring.policies.base.PodView`: the *prefill pool* (pods whose role is
``prefill`` or ``both``) and the *decode pool* (``decode`` or ``both``).  Each view is
built from its own pod's index entries only: a decode pod's cache never shows up in a
prefill pod's view (sglang#25184: a router that mixed the two views flipped requests
between workers).  A ``both`` pod is in both lists, each time with its own view.

For one request with ``P`` prompt tokens, block size ``B``:

1. **Decode pod** — the lowest *decode score* over the decode pool::

       batch      = running (scraped) if known, else inflight (router-tracked)
       need       = ceil((P + max_tokens) / B)          # blocks the request will hold
       free       = capacity_blocks * (1 - kv_usage)    # when both are known
       score      = batch
                    + outstanding_prefill_tokens / tokens_per_request
                    + kv_weight * kv_usage
                    + (no_room_penalty if free < need else 0)

   ``tokens_per_request`` turns the prompt tokens still being prefilled or transferred
   there into request-equivalents.  Ties (within ``tie_epsilon``) go to the pod holding
   the most leading blocks of the prompt (a decode pod pulls only the blocks it does not
   hold, vLLM's ``get_num_new_matched_tokens``), then to a hash of the request id.

2. **Prefill pod** — the caller's cache-aware policy object (``cost`` by default, any
   registered policy) over the prefill pool, minus the chosen decode pod.  It is told
   ``on_routed`` / ``on_complete`` like any policy, so its bookkeeping (in-flight
   prefixes, queued-hit ledger) sees only prefill traffic.

3. **Split or not** -- the issue's two tests (Dynamo's conditional disaggregation has
   the same two: a prefill length and a prefill-queue bound), with
   ``rate`` = ``prefill_rate_tokens_per_s`` and ``T_d = uncached_d / rate``::

       uncached_d = P - min(hits(D) * B, P - 1)         # what D would compute locally
       direct ("short") if uncached_d < min_uncached_tokens
       hop   = queued(Pp) / rate                        # the prefill pod's queue
               + (uncached_p - uncached_d) / rate       # what Pp computes that D would not
               + pull_blocks * transfer_s_per_block + hop_overhead_s
       local = D.outstanding_prefill_tokens / rate + T_d
               + itl_weight * batch(D) * T_d
       direct ("local_faster") if hop > local, else split (prefill on Pp, decode on D)

   ``queued(Pp)`` is the prefill policy's prediction of the uncached tokens queued on
   Pp when it keeps one (``cost``: ``outstanding_prefill_tokens`` scaled by the miss
   share it predicted for the requests it sent there, which have mostly cached prompts
   in multi-turn and agentic traffic), else ``outstanding_prefill_tokens`` (whole
   prompts, cached parts included).  D's queue is its ``outstanding_prefill_tokens``:
   whole prompts for direct requests, only the uncomputed tail for pulled ones.
   ``hop`` is everything a split adds beyond the prefill computation a local prefill
   needs too: the prefill pod's queue, the part of the prompt its cache lacks that D's
   holds (negative when Pp holds more), the pull of the
   ``pull_blocks = ceil(P / B) - hits(D)`` blocks D does not hold and the extra request.
   ``local`` is the local prefill: D's own queue, the computation, and the decode time
   it steals from D's ``batch`` running requests (chunked prefill shares the engine
   steps; weighed by ``itl_weight``).  The prefill computation itself is not charged to
   the split: moving it off the decode pod is what a P/D fleet's prefill pool is
   provisioned for.  So a long uncached prompt on an idle fleet splits (``hop`` is the
   pull and the request overhead, milliseconds; ``local`` is ``T_d``, at least
   ``min_uncached_tokens / rate`` = 51 ms by default), and it goes direct once the
   prefill pool's queue is longer than the local prefill would take.  In TTFT terms, a
   split may cost up to one local prefill time more than a local prefill would: the
   price of keeping the prefill off the decode pod, which vLLM's router and llm-d's
   decider pay unconditionally (they test the uncached length only).  With no prefill
   pod left (or an empty pool) the request goes direct.  ``always_split`` skips both
   tests (every request is split, as vLLM's toy proxy does).

Defaults and where they come from (scoring/policies/README.md has the table):
``min_uncached_tokens = 256`` (the value the issue cites for vLLM's router; llm-d's
``prefix-disaggregation-decider`` compares the same quantity, ``nonCachedTokens``, whose
default 0 never splits); ``transfer_s_per_block = 1e-4`` (Llama-3.1-8B bf16: 32 layers x
8 KV heads x 128 x 2 x 2 bytes = 128 KiB a token, 2 MiB a 16-token block, over a
200 Gb/s NIC); ``hop_overhead_s = 0.002`` (one more HTTP request and the transfer
notification, an estimate); ``prefill_rate_tokens_per_s = 5000`` (the ``cost`` policy's);
``itl_weight = 1`` (a second of one user's stalled decode weighs as a second of TTFT).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import xxhash
from pydantic import Field

from scoring.policies.base import Decision, PodView, Policy, PolicyParams, RouteRequest

_h64 = xxhash.xxh3_64_intdigest

Reason = Literal["split", "short", "local_faster", "no_prefill_pod"]


@runtime_checkable
class QueuePredictor(Protocol):
    """A prefill policy that predicts a pod's queued uncached prompt tokens."""

    def queued_tokens(self, pod: PodView) -> float: ...


class PDParams(PolicyParams):
    """Parameters of :class:`PDRouter` (unknown fields are an error)."""

    min_uncached_tokens: int = Field(
        default=256, ge=0, description="split only when D would compute at least this many"
    )
    prefill_rate_tokens_per_s: float = Field(
        default=5000.0, gt=0.0, description="prompt tokens a pod prefills per second"
    )
    transfer_s_per_block: float = Field(
        default=1e-4, ge=0.0, description="seconds to pull one KV block from P to D"
    )
    hop_overhead_s: float = Field(
        default=0.002, ge=0.0, description="fixed cost of the extra prefill request"
    )
    itl_weight: float = Field(
        default=1.0, ge=0.0, description="weight of decode time a local prefill steals"
    )
    tokens_per_request: float = Field(
        default=2048.0, gt=0.0, description="prefill tokens that count as one running request"
    )
    kv_weight: float = Field(default=4.0, ge=0.0, description="decode score per unit KV usage")
    no_room_penalty: float = Field(
        default=1000.0, ge=0.0, description="decode score added when the request does not fit"
    )
    default_output_tokens: int = Field(
        default=256, ge=1, description="output length assumed when max_tokens is unset"
    )
    always_split: bool = Field(
        default=False,
        description="split every request a prefill pod can take (vLLM's toy proxy)",
    )
    tie_epsilon: float = Field(default=1e-9, ge=0.0, description="decode scores this close tie")
    seed: int = 0


@dataclass(slots=True)
class PDDecision:
    """Where one request goes: always a decode pod; a prefill pod when it is split."""

    decode_pod: str
    prefill_pod: str | None
    reason: Reason
    decode_scores: dict[str, float]
    prefill: Decision | None = None
    #: the predictions behind the choice (seconds, tokens), for /v1/route and tests
    predicted: dict[str, float] = field(default_factory=dict)

    @property
    def split(self) -> bool:
        return self.prefill_pod is not None


def _batch(view: PodView) -> int:
    return view.running if view.running is not None else view.inflight


def _cached_tokens(view: PodView, prompt_tokens: int, block_size: int) -> int:
    """Prompt tokens ``view``'s pod would not recompute (the last one always is)."""
    return min(view.best_cached_blocks() * block_size, max(0, prompt_tokens - 1))


class PDRouter:
    """Chooses (decode pod, optional prefill pod) per request; see the module docstring."""

    def __init__(self, prefill_policy: Policy, params: PDParams | None = None) -> None:
        self.prefill_policy = prefill_policy
        self.params = params if params is not None else PDParams()

    def decode_score(self, request: RouteRequest, view: PodView) -> float:
        p = self.params
        score = _batch(view) + view.outstanding_prefill_tokens / p.tokens_per_request
        if view.kv_usage is not None:
            score += p.kv_weight * view.kv_usage
            if view.capacity_blocks is not None:
                out = request.max_tokens or p.default_output_tokens
                need = math.ceil((request.prompt_tokens + out) / request.block_size)
                free = view.capacity_blocks * (1.0 - view.kv_usage)
                if free < need:
                    score += p.no_room_penalty
        return score

    def pick_decode(
        self, request: RouteRequest, pods: Sequence[PodView]
    ) -> tuple[PodView, dict[str, float]]:
        if not pods:
            raise ValueError("no decode-capable pod (role decode or both) for the request")
        scores = {v.pod: self.decode_score(request, v) for v in pods}
        low = min(scores.values())
        tied = [v for v in pods if scores[v.pod] <= low + self.params.tie_epsilon]
        most = max(v.best_cached_blocks() for v in tied)
        tied = [v for v in tied if v.best_cached_blocks() == most]
        seed = self.params.seed
        best = max(tied, key=lambda v: _h64(f"{request.request_id}\x00{v.pod}".encode(), seed))
        return best, scores

    def pick(
        self,
        request: RouteRequest,
        prefill_pods: Sequence[PodView],
        decode_pods: Sequence[PodView],
    ) -> PDDecision:
        """Decide for ``request``; the prefill policy is *not* told ``on_routed`` (the
        caller does that once the split is really sent, see :meth:`on_routed`)."""
        p = self.params
        d, scores = self.pick_decode(request, decode_pods)
        n, bs = request.prompt_tokens, request.block_size
        uncached_d = n - _cached_tokens(d, n, bs)
        predicted: dict[str, float] = {"uncached_decode_tokens": float(uncached_d)}
        if uncached_d < p.min_uncached_tokens and not p.always_split:
            return PDDecision(d.pod, None, "short", scores, predicted=predicted)
        pool = [v for v in prefill_pods if v.pod != d.pod]
        if not pool:
            return PDDecision(d.pod, None, "no_prefill_pod", scores, predicted=predicted)
        prefill = self.prefill_policy.pick(request, pool)
        pp = next(v for v in pool if v.pod == prefill.pod)
        rate = p.prefill_rate_tokens_per_s
        uncached_p = n - _cached_tokens(pp, n, bs)
        pull_blocks = max(0, math.ceil(n / bs) - d.best_cached_blocks())
        t_d = uncached_d / rate
        local = d.outstanding_prefill_tokens / rate + t_d + p.itl_weight * _batch(d) * t_d
        hop = (self.queued_tokens(pp) + uncached_p - uncached_d) / rate
        hop += pull_blocks * p.transfer_s_per_block + p.hop_overhead_s
        predicted.update(
            uncached_prefill_tokens=float(uncached_p),
            pull_blocks=float(pull_blocks),
            local_cost_s=local,
            hop_cost_s=hop,
        )
        if hop > local and not p.always_split:
            return PDDecision(d.pod, None, "local_faster", scores, prefill, predicted)
        return PDDecision(d.pod, pp.pod, "split", scores, prefill, predicted)

    def queued_tokens(self, view: PodView) -> float:
        """The prefill pod's predicted queue in uncached tokens: the prefill policy's
        estimate when it keeps one (``cost``: its outstanding prompts scaled by the miss
        share it predicted for them), else every outstanding prompt token."""
        if isinstance(self.prefill_policy, QueuePredictor):
            return self.prefill_policy.queued_tokens(view)
        return float(view.outstanding_prefill_tokens)

    def on_routed(self, request: RouteRequest, decision: PDDecision) -> None:
        """The request was sent as decided: the prefill policy hears its half."""
        if decision.prefill_pod is not None:
            self.prefill_policy.on_routed(request, decision.prefill_pod)

    def on_prefill_complete(self, request: RouteRequest, decision: PDDecision) -> None:
        """The prefill half finished (its response came back, or it failed)."""
        if decision.prefill_pod is not None:
            self.prefill_policy.on_complete(request, decision.prefill_pod)

    def on_pod_removed(self, pod: str) -> None:
        self.prefill_policy.on_pod_removed(pod)
