"""How much each running request slows a pod's prefill, learned from clean first tokens.

``cost`` multiplies a pod's prefill time by ``1 + slowdown x running``.  An operator can
set the slowdown (``kvroute calibrate`` prints the engine's); unset, it is learned here.
Only *clean* observations count: a request that found its pod with nothing queued (no
prefill outstanding, nothing waiting, its previous first token before this routing)
and with KV room for its prompt.  Its service, routing to first token, is then its own
prefill beside the pod's running decodes, and::

    service ~ c + a * tokens + b * tokens * running + d * running,    slowdown = b / a

a least-squares fit of three slopes with an intercept, each slope's prior (``a``: 1 /
the rate setting; ``b``, ``d``: 0) weighing as ``prior_weight`` typical observations,
forgetting like the prefill rate's.  ``d`` is there because a first token needs at least
one engine step and every running request's decode lengthens every step, however short
the prompt: in the replay's vLLM pods, 427 tokens beside 121 running requests took 0.39 s
and 8,017 tokens 0.37 s (docs/history/quality_matrix.md, "Session 23").  A fit without it read that
floor as a slowdown of the prompt's tokens, and the floor's spread as noise that kept the real
slowdown under its test.  ``d`` (:attr:`SlowdownFit.per_running_s`, kept >= 0, no
test) is that step's floor: since session 26 ``cost`` charges it once for each request
waiting on a pod and once for the newcomer (``charge_decode_steps``,
scoring/policies/cost.py).  On overloaded pods the clean first tokens show ``d`` and no
``b`` (``python tests/bench/bench_slowdown_signal.py``: ``b / a`` within +-0.02, ``d``
0.4-3.5 ms a running request, docs/history/quality_matrix.md, "Session 26").  A burst's queueing
and the wait for KV room also grow with the running count; a fit over every first token read them as
a slowdown of 2-4 per running request where the engine's was 0.0015
(docs/history/quality_matrix.md, "Session 22").  A fit that says a pod prefills faster the more it
runs gives 0, and so does one whose slope is within two standard errors of 0 (a few early
observations read a slowdown of 15 per running request on an idle fleet, and the placements it
scattered never recovered).  A regressor whose remembered values no longer vary
(:func:`one_value`: an idle spell with nothing running, for long enough that the earlier
spread has sunk into rounding or underflow) leaves the fit as it was: solved, it learned
a step time of 0.3-17.6 ms from nothing where 10 ms had been shown (session 34).  The
slowdown is always finite and >= 0.

The sums take every observation; the solve runs on each of the first
:data:`REFIT_EVERY`, then on every :data:`REFIT_EVERY`-th (as ``measured``'s fits do,
scoring/policies/pod_rates.py).  It is over half of the fit's cost (about 9,000 of
16,500 CPU instructions an observation in the pure-Python build, docs/history/quality_matrix.md,
"Session 24"), and the slowdown drifts over tens of observations, not one.
"""

from __future__ import annotations

import math

from scoring.policies.base import PodView

_INF = math.inf
#: the system's determinant over the product of its diagonal below which the regressors
#: are too collinear to tell apart (the joint fit is rounding error)
_COLLINEAR = 1e-6
#: a centered sum of squares below this share of the raw one is the sums' rounding, not
#: a spread (:func:`one_value`; real spreads are far above it: 5 and 21 tokens in one
#: request of 8 give 0.36)
_ROUNDING = 1e-9
#: a variance below this (squared: a thousandth of a token or of a running request) is
#: one value too (:func:`one_value`)
_ONE_VALUE = 1e-6
#: a slope counts when it is this many standard errors squared from 0 (2 sigma: the
#: usual 95% convention, not fitted)
_T2 = 4.0
#: solve once per this many observations after the first ones (the module docstring)
REFIT_EVERY = 4


class SlowdownFit:
    """The fit of the module docstring, pooled over a model's pods."""

    __slots__ = (
        "_a0",
        "_count",
        "_decay",
        "_n",
        "_pw",
        "_r",
        "_rr",
        "_ry",
        "_x1",
        "_x1r",
        "_x1x1",
        "_x1x2",
        "_x1y",
        "_x2",
        "_x2r",
        "_x2x2",
        "_x2y",
        "_y",
        "_yy",
        "per_running_s",
        "slowdown",
    )

    def __init__(self, prior_rate: float, memory: float, prior_weight: float) -> None:
        self._a0 = 1.0 / prior_rate
        self._decay = 1.0 - 1.0 / memory
        self._pw = float(prior_weight)
        self._count = 0
        self._n = 0.0
        # forgetting sums of the regressors (x1 tokens, x2 tokens x running, r running),
        # the service y and their products (floats, not a list: unboxed when compiled)
        self._x1 = self._x2 = self._r = self._y = 0.0
        self._x1x1 = self._x2x2 = self._rr = self._x1x2 = self._x1r = self._x2r = 0.0
        self._x1y = self._x2y = self._ry = self._yy = 0.0
        #: fractional prefill slowdown per running request (the prior: 0)
        self.slowdown = 0.0
        #: seconds each running request adds to an engine step (``d``, >= 0; the prior: 0)
        self.per_running_s = 0.0

    def add(self, tokens: float, running: float, service: float) -> None:
        """One clean observation (the caller checked it is finite and >= 0)."""
        g = self._decay
        x2 = tokens * running
        self._x1 = s1 = self._x1 * g + tokens
        self._x2 = s2 = self._x2 * g + x2
        self._r = s3 = self._r * g + running
        self._y = sy = self._y * g + service
        self._x1x1 = s11 = self._x1x1 * g + tokens * tokens
        self._x2x2 = s22 = self._x2x2 * g + x2 * x2
        self._rr = s33 = self._rr * g + running * running
        self._x1x2 = s12 = self._x1x2 * g + tokens * x2
        self._x1r = s13 = self._x1r * g + tokens * running
        self._x2r = s23 = self._x2r * g + x2 * running
        self._x1y = s1y = self._x1y * g + tokens * service
        self._x2y = s2y = self._x2y * g + x2 * service
        self._ry = s3y = self._ry * g + running * service
        self._yy = syy = self._yy * g + service * service
        n = self._n = self._n * g + 1.0
        pw = self._pw = self._pw * g
        count = self._count = self._count + 1
        if count > REFIT_EVERY and count % REFIT_EVERY:
            return  # summed; solved on the next REFIT_EVERY-th
        m1, m2, m3 = s1 / n, s2 / n, s3 / n
        c11 = s11 - m1 * s1
        c22 = s22 - m2 * s2
        c33 = s33 - m3 * s3
        if one_value(c11, s11, n) or one_value(c22, s22, n) or one_value(c33, s33, n):
            return  # a regressor of one value: its slope cannot be told (keep the fit's)
        c12 = s12 - m1 * s2
        c13 = s13 - m1 * s3
        c23 = s23 - m2 * s3
        c1y = s1y - m1 * sy
        c2y = s2y - m2 * sy
        c3y = s3y - m3 * sy
        w1 = pw * (c11 / n + 1.0)
        d11 = c11 + w1
        d22 = c22 + pw * (c22 / n + 1.0)
        d33 = c33 + pw * (c33 / n + 1.0)
        e1 = c1y + w1 * self._a0
        # the inverse of the symmetric 3 x 3 system, by cofactors
        i11 = d22 * d33 - c23 * c23
        i12 = c13 * c23 - c12 * d33
        i13 = c12 * c23 - c13 * d22
        i22 = d11 * d33 - c13 * c13
        i23 = c12 * c13 - d11 * c23
        i33 = d11 * d22 - c12 * c12
        det = d11 * i11 + c12 * i12 + c13 * i13
        if d11 <= 0.0 or not det > _COLLINEAR * d11 * d22 * d33:
            return  # nothing tells the slopes apart: keep the slowdown
        a = (i11 * e1 + i12 * c2y + i13 * c3y) / det
        b = (i12 * e1 + i22 * c2y + i23 * c3y) / det
        d = (i13 * e1 + i23 * c2y + i33 * c3y) / det
        if not (0.0 < a < _INF and -_INF < b < _INF and -_INF < d < _INF):
            return
        self.per_running_s = d if d > 0.0 else 0.0
        # a slowdown only where the observations tell one: b at least two standard
        # errors above 0 (the residual variance over n - 4 degrees of freedom)
        dof = n - 4.0
        if b <= 0.0 or dof <= 0.0:
            self.slowdown = 0.0
            return
        rss = (syy - sy * sy / n) - a * c1y - b * c2y - d * c3y
        var_b = (rss if rss > 0.0 else 0.0) / dof * i22 / det
        self.slowdown = b / a if b * b >= _T2 * var_b else 0.0


def one_value(centered: float, raw: float, n: float) -> bool:
    """Whether the values a forgetting sum remembers have no spread: their centered sum
    of squares ``centered`` is within the rounding of the raw one ``raw`` (every value
    the same), or below a thousandth squared per observation (``n``).  That also catches
    sums whose spread came from observations so old that their forgotten weight has sunk
    into the floats' underflow (about 180,000 observations later at a memory of 256),
    where a fit solves rounding.  No spread tells no slope: the fits keep their values
    (here and scoring/policies/learned_rate.py)."""
    return centered <= _ROUNDING * raw or centered < _ONE_VALUE * n


def clean_running(view: PodView, prompt_blocks: int) -> int:
    """``view``'s running requests if a request of ``prompt_blocks`` routed there now is
    a clean observation (nothing of its queued, nothing waiting, KV room for the prompt
    where the pod says how much it has), else -1."""
    if view.outstanding_prefill_tokens or view.waiting:
        return -1
    cap, usage = view.capacity_blocks, view.kv_usage
    if cap and usage is not None and cap * (1.0 - usage) < prompt_blocks:
        return -1
    return view.running if view.running is not None else view.inflight
