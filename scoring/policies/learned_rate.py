"""A model's prefill rate, learned from the first tokens the router sees.

``cost`` prices queued and uncached prompt tokens in seconds at a prefill rate.  An
operator can set it (``prefill_rate_tokens_per_s``), but a router in front of real pods
should not need to know their GPUs: :class:`PrefillRate` measures it from the requests
it routes.  A pod prefills FCFS, so each first token closes the pod's service of one
request, which began when it was routed or when the previous first token of the same pod
came back, whichever is later (the time before is queueing, the time after belongs to the
next request).  A pod's service of a request is its per-request time (an engine step,
the API server) plus its uncached tokens at the prefill rate, so the rate is the slope
of a least-squares line through the observations::

    service = first token - max(routed at, the pod's previous first token)
    service ~ c + tokens / rate          (tokens: the policy's predicted uncached ones)
    1/rate  = (cov(tokens, service) * n + w * 1/prior) / (var(tokens) * n + w)

with ``n`` the observations and ``w = prior_weight * (var(tokens) + 1)``: the prior's
slope weighs as ``prior_weight`` typical observations.  A
ratio of sums (tokens over seconds) would charge the per-request time to the tokens:
on a fleet whose requests are mostly cache hits it read a 28,000 tokens/s engine at
1,600.  Observations that cannot tell a slope (every request the same size) change
nothing: the rate stays the prior, or the last one learned.  That includes a long run of
one size after a spread, once what the sums keep of the spread is below their rounding
or a thousandth of a token (:func:`~scoring.policies.slowdown_fit.one_value`).  Without
that, a fleet serving one repeated, fully cached prompt (a load test; 0 uncached tokens
each) was read at 2 tokens/s instead of about 60,000 after some 180,000 requests: the
one miss's weight in the sums had sunk into the floats' underflow (session 34,
``bench_wrk_overhead.py``).  A fit that comes out non-positive keeps the last rate.

The tokens are the ones the policy predicted uncached, so the rate is the one that turns
the policy's own predictions into seconds: hits it over-counted (blocks evicted before
the request ran) lower it, as do the decode steps sharing the GPU.  Pooled over the pods
of a model (``cost`` keeps one per model: they usually run on one kind of GPU; a rate
per pod would let noise break the ties that spread new prefixes).  Measured on fleets
whose pods differ in speed (the matrix's ``mixed`` fleets, session 18): a per-pod fit
with the pooled rate as its prior did worse than the pooled rate, on those cells and on
equal ones (TTFT p90 / best geomean 1.099 against 1.064, vLLM seed 31, 28 cells), and so
did using it for the queued work only (1.091).  A slow pod's queue drains slowly, and the
queued tokens already show it.

The sums forget: each observation multiplies them by ``1 - 1 / memory``, the prior's
weight too.  Bad input (a NaN or negative token count, a first token before its routing,
a clock that is not finite) is dropped and counted by reason in :attr:`rejected`; the
rate is always finite and positive.
"""

from __future__ import annotations

import math
from collections import Counter

from scoring.policies.kv_admission import DecodeTimes
from scoring.policies.slowdown_fit import SlowdownFit, one_value

#: observations the sums remember (the same memory as the decode times of
#: scoring/policies/kv_admission.py)
MEMORY = 256.0
#: observations the prior weighs as (``measured``'s default prior weight)
PRIOR_WEIGHT = 4.0
_INF = math.inf


class PrefillRate:
    """Prompt tokens per second a model's pods prefill, learned online (module docstring)."""

    __slots__ = (
        "_decay",
        "_last",
        "_n",
        "_prior",
        "_pw",
        "_sec",
        "_tok",
        "_ts",
        "_tt",
        "rate",
        "rejected",
    )

    def __init__(
        self, prior_rate: float, memory: float = MEMORY, prior_weight: float = PRIOR_WEIGHT
    ) -> None:
        if not (math.isfinite(prior_rate) and prior_rate > 0):
            raise ValueError(f"prior_rate must be finite and > 0, got {prior_rate}")
        self._prior = prior_rate
        self._decay = 1.0 - 1.0 / memory
        self._pw = prior_weight
        self._tok = 0.0
        self._tt = 0.0
        self._ts = 0.0
        self._sec = 0.0
        self._n = 0.0
        #: pod -> its latest first token (where its next service starts, FCFS)
        self._last: dict[str, float] = {}
        #: tokens/s: the prior until the first observation
        self.rate = prior_rate
        #: rejected observations, by reason
        self.rejected: Counter[str] = Counter()

    def first_token(
        self,
        pod: str,
        routed_at: float,
        now: float,
        tokens: float,
        running: float = -1.0,
        slowdown: SlowdownFit | None = None,
    ) -> str | None:
        """A request routed to ``pod`` at ``routed_at`` with ``tokens`` predicted uncached
        had its first token at ``now``; returns the reason it was rejected, else None.
        With ``slowdown``, a request routed clean (``running`` >= 0: the pod's running
        requests then) whose pod had no first token pending also feeds that fit."""
        if 0 <= tokens < _INF and -_INF < routed_at <= now < _INF:  # (NaN fails)
            last = self._last.get(pod)
            if slowdown is not None and 0 <= running < _INF and (last is None or last <= routed_at):
                slowdown.add(tokens, running, now - routed_at)
            start = routed_at if last is None or last < routed_at else last
            if last is None or now > last:
                self._last[pod] = now
            service = now - start if now > start else 0.0  # answered out of order: 0
            g = self._decay  # (in locals: this runs on every first token)
            self._tok = tok = self._tok * g + tokens
            self._sec = sec = self._sec * g + service
            self._n = n = self._n * g + 1.0
            self._pw = pw = self._pw * g
            self._tt = tt = self._tt * g + tokens * tokens
            self._ts = ts = self._ts * g + tokens * service
            mean_tokens = tok / n
            var_n = tt - mean_tokens * tok  # var(tokens) * n
            if one_value(var_n, tt, n):  # one size: no slope to tell
                return None
            cov_n = ts - mean_tokens * sec  # cov(tokens, service) * n
            w = pw * (var_n / n + 1.0)
            den = var_n + w
            if den > 0.0:  # (a spread and the prior's weight: always; kept as a guard)
                slope = (cov_n + w / self._prior) / den
                if 0.0 < slope < _INF:
                    self.rate = 1.0 / slope
            return None
        if not 0 <= tokens < _INF:
            reason = "tokens"
        elif not (math.isfinite(routed_at) and math.isfinite(now)):
            reason = "clock"
        else:
            reason = "first token before routing"
        self.rejected[reason] += 1
        return reason

    def seen(self) -> bool:
        """Whether any first token has been observed."""
        return self._n > 0.0

    def per_request_s(self) -> float:
        """The fit's intercept, at the rate in use: the seconds a request takes whatever
        its tokens (an engine step, the API server); 0 before any observation, never
        negative."""
        if self._n <= 0.0:
            return 0.0
        c = (self._sec - self._tok / self.rate) / self._n
        return c if c > 0.0 else 0.0

    def forget(self, pod: str) -> None:
        """``pod`` left the fleet."""
        self._last.pop(pod, None)


class ModelRates:
    """What one model's pods showed a policy: its prefill rate (None: not learned) and
    its decode times (scoring/policies/kv_admission.py).  Per model: a router in front
    of an 8B and a 70B model learns each its own."""

    __slots__ = ("decode", "prefill", "slowdown")

    def __init__(self, prefill: PrefillRate | None, slowdown: SlowdownFit | None = None) -> None:
        self.prefill = prefill
        self.decode = DecodeTimes()
        #: the learned slowdown per running request (None: the setting is used)
        self.slowdown = slowdown
