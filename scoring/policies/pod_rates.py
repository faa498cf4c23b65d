"""Online estimates of one pod's service rates, learned from what the router observes.

Used by the ``measured`` policy (:mod:`scoring.policies.measured`).  Every estimate is a
ridge-regularised least-squares fit with exponential forgetting: each observation
multiplies the accumulated sums by ``1 - 1 / memory`` before adding itself, so the fit
follows a pod whose speed changes, over about ``memory`` observations.  Before any data
arrives (and while the data cannot identify a coefficient) the fit returns its *prior*;
the prior weighs as ``prior_weight`` typical observations and is forgotten as they are,
so data dominates after a few and the fit converges to the data's own.

* **Prefill** — per request, at its first token::

      service_s = c + a * tokens + b * tokens * running

  ``service_s`` is the time the pod spent on this request's prefill as a FCFS queue
  shows it: ``first token - max(routed at, previous first token on the pod)``;
  ``tokens`` the prompt tokens the router predicted uncached; ``running`` the pod's
  running requests when it was routed.  ``1 / a`` is the prefill rate of an idle pod,
  ``b / a`` the fractional slowdown per running request (decode steps sharing the GPU),
  ``c`` the fixed cost of a request (one engine step, scheduling).
* **Decode** — per request, at its last token::

      step_s = d + e * decoding

  ``step_s = (last token - first token) / (output tokens - 1)``; ``decoding`` the
  requests the router had past their first token on the pod at this one's first token.
* **Arrivals** — per routed request, the gap since the previous one routed to the pod:
  ``rate = 1 / mean gap``, and ``utilisation = mean service / mean gap``.  The gap open
  now (since the last arrival) bounds the mean from below, so a pod that stops receiving
  traffic is seen to cool down without any timer.

A regressor whose remembered values no longer vary (a load test's one prompt size, an
idle spell with nothing running or decoding) cannot tell its coefficient from the
intercept: the fit keeps the coefficient it had.  Solved, 5-token hits after a spread
of sizes read a 12,000 tokens/s pod at 810-840 (the ridge floor splitting their time
between ``c`` and ``a``), 0-token ones at the prior (once the spread's sums fell under
the solve's 1e-12 guard, some 3,000 observations on), and an idle spell lost ``b``, ``e``.

Bad observations (NaN, infinite, negative times or token counts) are dropped, counted
per reason in :attr:`Calibration.rejected` and logged once per reason; a fit that comes
out non-finite or non-positive falls back to the prior, counted per fit in
:attr:`Calibration.prior_fallbacks` (the observations were fine: not a rejection, not
logged).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from scoring.policies.slowdown_fit import one_value

log = logging.getLogger(__name__)

#: the prior's weight never falls below this share of an observation: a numerical
#: guard that keeps collinear data (e.g. a constant running count) solvable
_RIDGE_FLOOR = 1e-6
#: refit once per this many observations after the first ones: the solve costs more
#: than the rest of a request's bookkeeping, and rates drift over tens of requests
REFIT_EVERY = 4
#: a regressor's remembered spread (centered sum of squares) below this many ridge
#: floors is one value too: the floor would decide its coefficient
_FLOORS = 1e3


@dataclass
class Calibration:
    """Counts of rejected calibration input, shared by every pod of one policy."""

    rejected: Counter[str] = field(default_factory=Counter)
    #: fits ("prefill", "decode") that solved to a coefficient <= 0 and kept the prior:
    #: a state of the data (e.g. too little spread yet), not bad input, so neither
    #: logged nor counted as a rejection
    prior_fallbacks: Counter[str] = field(default_factory=Counter)
    _logged: set[str] = field(default_factory=set)

    def reject(self, pod: str, reason: str, value: object) -> None:
        self.rejected[reason] += 1
        if reason not in self._logged:
            self._logged.add(reason)
            log.warning(
                "pod %s: ignoring bad calibration input (%s: %r); "
                "further %s rejections are counted, not logged",
                pod,
                reason,
                value,
                reason,
            )


def _finite_nonneg(*xs: float) -> bool:
    return all(isinstance(x, (int, float)) and math.isfinite(x) and x >= 0 for x in xs)


class RidgeFit:
    """Exponentially forgotten least squares ``y ~ theta . x`` with a ridge prior and
    ``theta >= 0`` (negative coefficients pinned to 0 one at a time, the rest refitted).
    ``x[0]`` is 1 (the intercept); a coefficient whose regressor has no spread keeps its
    value."""

    __slots__ = (
        "_count",
        "_decay",
        "_n",
        "_positive",
        "_prior",
        "_prior_weight",
        "_sxx",
        "_sxy",
        "theta",
    )

    def __init__(
        self,
        prior: Sequence[float],
        memory: float,
        prior_weight: float,
        positive: Sequence[int] = (),
    ) -> None:
        """``positive``: coefficients a fit must keep > 0 (else it falls back to the prior)."""
        k = len(prior)
        self._positive = tuple(positive)
        self._count = 0
        self._prior = tuple(float(v) for v in prior)
        self._decay = 1.0 - 1.0 / memory
        self._prior_weight = prior_weight
        self._n = 0.0
        self._sxx = [[0.0] * k for _ in range(k)]
        self._sxy = [0.0] * k
        self.theta: tuple[float, ...] = self._prior

    @property
    def observations(self) -> float:
        """The forgotten count of observations (at most ``memory``)."""
        return self._n

    def add(self, x: Sequence[float], y: float) -> bool:
        """Add one observation and refit (each of the first :data:`REFIT_EVERY`, then
        every :data:`REFIT_EVERY`-th); ``False`` when the fit fell back to the prior."""
        g = self._decay
        k = len(x)
        self._n = self._n * g + 1.0
        self._prior_weight *= g  # the prior is forgotten like an early observation
        for i in range(k):
            row = self._sxx[i]
            xi = x[i]
            for j in range(k):
                row[j] = row[j] * g + xi * x[j]
            self._sxy[i] = self._sxy[i] * g + xi * y
        self._count += 1
        if self._count > REFIT_EVERY and self._count % REFIT_EVERY:
            return True
        theta = self._solve()
        if theta is None or any(not theta[i] > 0 for i in self._positive):
            self.theta = self._prior
            return False
        self.theta = theta
        return True

    def _solve(self) -> tuple[float, ...] | None:
        k = len(self._prior)
        n = max(self._n, 1.0)
        # the prior weighs as prior_weight observations of this coefficient's mean scale
        pw = max(self._prior_weight, _RIDGE_FLOOR)
        lam = [pw * self._sxx[i][i] / n + 1e-12 for i in range(k)]
        a = [[self._sxx[i][j] + (lam[i] if i == j else 0.0) for j in range(k)] for i in range(k)]
        # a regressor of one value (its spread gone, or too small to outweigh the ridge
        # floor) cannot tell its coefficient from the intercept: keep the coefficient
        kept = [0.0] * k
        free = [0]
        for i in range(1, k):
            sii, si = self._sxx[i][i], self._sxx[0][i]
            centered = sii - si * si / self._n
            if one_value(centered, sii, self._n) or centered < _FLOORS * _RIDGE_FLOOR * sii / n:
                kept[i] = self.theta[i]
            else:
                free.append(i)
        b = [
            self._sxy[i] + lam[i] * self._prior[i] - sum(a[i][j] * kept[j] for j in range(k))
            for i in range(k)
        ]
        # non-negative least squares, greedily: solve with every free coefficient;
        # while one comes out negative, pin the most negative to 0 and solve the rest
        while free:
            sol = _solve_linear([[a[i][j] for j in free] for i in free], [b[i] for i in free])
            if sol is None:
                return None
            worst = min(range(len(free)), key=lambda m: sol[m])
            if sol[worst] >= 0:
                theta = kept
                for i, v in zip(free, sol, strict=True):
                    theta[i] = v
                return tuple(theta)
            del free[worst]
        return tuple(kept) if any(kept) else None  # every free one pinned to 0


def _solve_linear(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; ``None`` when singular."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if not abs(m[p][c]) > 1e-300:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            for j in range(c, n + 1):
                m[r][j] -= f * m[c][j]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][j] * x[j] for j in range(r + 1, n))) / m[r][r]
    return x if all(math.isfinite(v) for v in x) else None


@dataclass(frozen=True, slots=True)
class Priors:
    """What the policy assumes of a pod before observing it."""

    prefill_rate_tokens_per_s: float
    prefill_slowdown_per_running: float
    request_overhead_s: float
    decode_step_s: float
    decode_step_per_running_s: float
    memory: float
    prior_weight: float


class PodRates:
    """The learned rates of one pod (see the module docstring)."""

    __slots__ = (
        "_gap_mean",
        "_last_arrival",
        "_last_first_token",
        "_service_mean",
        "_w",
        "decode",
        "prefill",
    )

    def __init__(self, priors: Priors) -> None:
        a = 1.0 / priors.prefill_rate_tokens_per_s
        self.prefill = RidgeFit(
            (priors.request_overhead_s, a, a * priors.prefill_slowdown_per_running),
            priors.memory,
            priors.prior_weight,
            positive=(1,),
        )
        self.decode = RidgeFit(
            (priors.decode_step_s, priors.decode_step_per_running_s),
            priors.memory,
            priors.prior_weight,
        )
        self._w = 1.0 - 1.0 / priors.memory
        self._gap_mean: float | None = None  # forgotten mean gap between arrivals
        self._service_mean: float | None = None  # forgotten mean prefill service time
        self._last_arrival: float | None = None
        self._last_first_token: float | None = None

    # --- what the policy reads --------------------------------------------------

    def prefill_s(self, tokens: float, running: float) -> float:
        """Seconds this pod takes to prefill ``tokens`` with ``running`` requests."""
        c, a, b = self.prefill.theta
        return c + tokens * (a + b * running)

    def token_s(self, running: float) -> float:
        """Seconds per prefill token with ``running`` requests."""
        _, a, b = self.prefill.theta
        return a + b * running

    def slowdown_s_per_token(self) -> float:
        """Extra prefill seconds per token per running request (``b``)."""
        return self.prefill.theta[2]

    def decode_step_s(self, decoding: float) -> float:
        d, e = self.decode.theta
        return d + e * decoding

    def arrival_rate(self, now: float) -> float:
        """Requests per second routed here (0 before two arrivals)."""
        gap = self._gap(now)
        return 1.0 / gap if gap > 0 else 0.0

    def utilisation(self, now: float) -> float:
        """Share of time the pod spends prefilling (may exceed 1: a growing queue)."""
        gap = self._gap(now)
        if gap <= 0 or self._service_mean is None:
            return 0.0
        return self._service_mean / gap

    def _gap(self, now: float) -> float:
        if self._gap_mean is None or self._last_arrival is None:
            return 0.0
        return max(self._gap_mean, now - self._last_arrival)

    # --- what the policy feeds --------------------------------------------------

    def arrived(self, now: float) -> None:
        last = self._last_arrival
        if last is not None and now >= last:
            gap = now - last
            m = self._gap_mean
            self._gap_mean = gap if m is None else m * self._w + gap * (1.0 - self._w)
        if last is None or now >= last:
            self._last_arrival = now

    def first_token(
        self, routed_at: float, now: float, tokens: float, running: float
    ) -> tuple[float, bool]:
        """Record a first token; returns ``(service seconds, fit ok)``."""
        start = routed_at
        if self._last_first_token is not None and self._last_first_token > start:
            start = self._last_first_token
        service = max(0.0, now - start)
        self._last_first_token = (
            now if self._last_first_token is None else max(now, self._last_first_token)
        )
        m = self._service_mean
        self._service_mean = service if m is None else m * self._w + service * (1.0 - self._w)
        ok = self.prefill.add((1.0, tokens, tokens * running), service)
        return service, ok

    def finished(self, decode_s: float, steps: int, decoding: float) -> bool:
        """Record a decode of ``steps`` steps (>= 1) taking ``decode_s``."""
        return self.decode.add((1.0, decoding), decode_s / steps)


def valid_observation(*xs: float) -> bool:
    """Finite and non-negative (times, token counts)."""
    return _finite_nonneg(*xs)
