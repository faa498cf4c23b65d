"""The fleet's prefill rate, learned from the first tokens the router sees.

``cost`` prices queued and uncached prompt tokens in seconds at a prefill rate.  An
operator can set it (``prefill_rate_tokens_per_s``), but a router in front of real pods
should not need to know their GPUs: :class:`PrefillRate` measures it from the requests
it routes.  A pod prefills FCFS, so each first token closes the pod's service of one
request, which began when it was routed or when the previous first token of the same pod
came back, whichever is later (the time before is queueing, the time after belongs to the
next request)::

    service = first token - max(routed at, the pod's previous first token)
    rate    = sum of predicted uncached tokens / sum of service     (forgotten sums)

The tokens are the ones the policy predicted uncached, so the rate is the one that turns
the policy's own predictions into seconds: hits it over-counted (blocks evicted before
the request ran) lower it, as do the engine's per-request costs and the decode steps
sharing the GPU.  Pooled over the fleet (one rate: pods of one model usually run on one
kind of GPU; a rate per pod would let noise break the ties that spread new prefixes).

The sums forget: each observation multiplies them by ``1 - 1 / memory``.  Before data
arrives the rate is the prior (the operator's setting, else the default); the prior
weighs as ``prior_weight`` observations of the mean observed size, and is forgotten like
one.  Bad input (a NaN or negative token count, a first token before its routing, a
clock that is not finite) is dropped and counted by reason in :attr:`rejected`; the rate
is always finite and positive.
"""

from __future__ import annotations

import math
from collections import Counter

#: observations the sums remember (the same memory as the decode times of
#: scoring/policies/kv_admission.py)
MEMORY = 256.0
#: observations the prior weighs as (``measured``'s default prior weight)
PRIOR_WEIGHT = 4.0
_INF = math.inf


class PrefillRate:
    """Prompt tokens per second the fleet prefills, learned online (module docstring)."""

    __slots__ = ("_decay", "_last", "_n", "_prior", "_pw", "_sec", "_tok", "rate", "rejected")

    def __init__(
        self, prior_rate: float, memory: float = MEMORY, prior_weight: float = PRIOR_WEIGHT
    ) -> None:
        if not (math.isfinite(prior_rate) and prior_rate > 0):
            raise ValueError(f"prior_rate must be finite and > 0, got {prior_rate}")
        self._prior = prior_rate
        self._decay = 1.0 - 1.0 / memory
        self._pw = prior_weight
        self._tok = 0.0
        self._sec = 0.0
        self._n = 0.0
        #: pod -> its latest first token (where its next service starts, FCFS)
        self._last: dict[str, float] = {}
        #: tokens/s: the prior until the first observation
        self.rate = prior_rate
        #: rejected observations, by reason
        self.rejected: Counter[str] = Counter()

    @property
    def observations(self) -> float:
        """The forgotten count of observations (at most ``memory``)."""
        return self._n

    def first_token(self, pod: str, routed_at: float, now: float, tokens: float) -> str | None:
        """A request routed to ``pod`` at ``routed_at`` with ``tokens`` predicted uncached
        had its first token at ``now``; returns the reason it was rejected, else None."""
        if 0 <= tokens < _INF and -_INF < routed_at <= now < _INF:  # (NaN fails)
            last = self._last.get(pod)
            start = routed_at if last is None or last < routed_at else last
            if last is None or now > last:
                self._last[pod] = now
            service = now - start if now > start else 0.0  # answered out of order: 0
            g = self._decay
            self._tok = self._tok * g + tokens
            self._sec = self._sec * g + service
            self._n = self._n * g + 1.0
            self._pw *= g
            mean_tokens = self._tok / self._n
            num = self._tok + self._pw * mean_tokens
            den = self._sec + self._pw * mean_tokens / self._prior
            if num > 0.0 and den > 0.0:
                self.rate = num / den
            return None
        if not 0 <= tokens < _INF:
            reason = "tokens"
        elif not (math.isfinite(routed_at) and math.isfinite(now)):
            reason = "clock"
        else:
            reason = "first token before routing"
        self.rejected[reason] += 1
        return reason

    def forget(self, pod: str) -> None:
        """``pod`` left the fleet."""
        self._last.pop(pod, None)
