"""What a model's pods show in their scraped metrics, for a router that never sees
their first tokens.

``cost`` learns its timing from the first tokens it sees (scoring/policies/learned_rate.py,
slowdown_fit.py, kv_admission.py).  A JSON answer forwarded as it came has none
(scoring/unseen_first_tokens.py), so with only such clients those fits keep their
priors, and the priors of the decode load are 0: a step time of 0 per running request
and no decode time.  The replay measured what that costs: the load's held prompts
released at each scrape, but nothing learned, `cost`'s TTFT p90 came out 1.2x worse
than with the prompts held to the end (seed 127, the quick matrix); fed the first
tokens for learning, 0.84x (README, "JSON answers").

The pods' own histograms give the decode load, at each scrape, per pod::

    step(interval)   = d(vllm:inter_token_latency_seconds_sum) / d(..._count)
    running(interval) = the mean of vllm:num_requests_running at its two ends
    step ~ c + per_running_s x running      (least squares over the intervals)
    decode time      = d(vllm:request_decode_time_seconds_sum) / d(..._count)

The slope is fitted as the prefill rate's (pooled over a model's pods, forgotten over
:data:`~scoring.policies.learned_rate.MEMORY` intervals, a prior of 0 weighing as
:data:`~scoring.policies.learned_rate.PRIOR_WEIGHT` intervals, nothing learned from
intervals whose running counts do not vary: :func:`~scoring.policies.slowdown_fit.one_value`).
``cost`` uses both only for a model it has seen no first token of: what the router
observes itself is per request and exact, a scrape is a mean over a second.  A counter
that goes down (an engine restart) starts the pod's deltas again; an interval with a
negative or non-finite delta is dropped and counted in :attr:`rejected`.
"""

from __future__ import annotations

import math

from scoring.policies.base import PodCounters
from scoring.policies.learned_rate import MEMORY, PRIOR_WEIGHT
from scoring.policies.slowdown_fit import one_value

_FORGET = 1.0 - 1.0 / MEMORY
_INF = math.inf


class ScrapedSteps:
    """The decode load a model's pods report (module docstring)."""

    __slots__ = ("_last", "_n", "_pw", "_x", "_xx", "_xy", "_y", "per_running_s", "rejected")

    def __init__(self) -> None:
        #: pod -> its last counters
        self._last: dict[str, PodCounters] = {}
        self._n = self._x = self._y = self._xx = self._xy = 0.0
        self._pw = PRIOR_WEIGHT
        #: seconds each running request adds to an engine step (the prior: 0)
        self.per_running_s = 0.0
        #: intervals dropped (a counter that went back or is not finite)
        self.rejected = 0

    def scraped(self, pod: str, now: PodCounters) -> float | None:
        """``pod``'s counters at a scrape; returns the mean decode time of the requests
        that finished since the last one (None: none did, or the pod does not say)."""
        last = self._last.get(pod)
        self._last[pod] = now
        if last is None:
            return None
        step = _delta_mean(last.itl_sum_s, last.itl_count, now.itl_sum_s, now.itl_count)
        if step is not None and last.running is not None and now.running is not None:
            if 0.0 <= step < _INF:
                self._add(0.5 * (last.running + now.running), step)
            else:
                self.rejected += 1
        decode = _delta_mean(
            last.decode_sum_s, last.decode_count, now.decode_sum_s, now.decode_count
        )
        if decode is not None and not 0.0 <= decode < _INF:
            self.rejected += 1
            return None
        return decode

    def _add(self, running: float, step: float) -> None:
        g = _FORGET
        self._n = n = self._n * g + 1.0
        self._pw = pw = self._pw * g
        self._x = x = self._x * g + running
        self._y = y = self._y * g + step
        self._xx = xx = self._xx * g + running * running
        self._xy = xy = self._xy * g + running * step
        mean = x / n
        var_n = xx - mean * x
        if one_value(var_n, xx, n):  # one running count: no slope to tell
            return
        slope = (xy - mean * y) / (var_n + pw * (var_n / n + 1.0))  # ridge toward 0
        self.per_running_s = slope if slope > 0.0 else 0.0

    def forget(self, pod: str) -> None:
        self._last.pop(pod, None)


def _delta_mean(
    sum0: float | None, count0: float | None, sum1: float | None, count1: float | None
) -> float | None:
    """(sum1 - sum0) / (count1 - count0): None when a value is missing, nothing was
    counted, or a counter went back (a restart: the next interval starts afresh)."""
    if sum0 is None or count0 is None or sum1 is None or count1 is None:
        return None
    dc = count1 - count0
    if not dc > 0.0 or sum1 < sum0:  # (NaN fails too)
        return None
    return (sum1 - sum0) / dc
