"""Fit the step-time model (:mod:`scoring.replay.step_cost`) to measured engine time.

``kvroute calibrate`` (:mod:`router.sim.calibrate`) runs probe requests against a real
engine and turns each into a :class:`Sample`: the work the probe's engine steps did
(the sum of their :func:`~scoring.replay.step_cost.features` rows, computed by
replaying the probe on vLLM's chunking rules) and the seconds the engine reports they
took (its ``vllm:request_prefill_time_seconds`` / ``vllm:request_decode_time_seconds``
histograms, or the client's clock when the pod exports neither).

Because ``step_s`` is linear in its five parameters, a probe of several steps is one
linear equation ``sum_of_rows . theta = seconds``; :func:`fit` solves them by weighted
least squares (weights ``1 / seconds``: the *relative* error is minimised, so a 5 ms
decode step counts as much as a 500 ms prefill) under ``theta >= 0`` (an active set:
the most negative parameter is pinned to 0 and the rest refitted).  The solve is a
5 x 5 normal-equations system by Gaussian elimination with partial pivoting (numpy is
not a dependency of the package).

Repeats of one probe are reduced to the fastest (:func:`fastest`, the default: the
engine's cost unloaded) or to the median (:func:`typical`: its cost under the load the
machine had) before fitting.

**Bad input falls back to the priors** (the base preset's parameters), never to NaN:

* a sample whose seconds or features are NaN, infinite, zero or negative is dropped and
  counted under its reason (``rejected``);
* a parameter whose feature no remaining sample exercises, or that the samples cannot
  tell apart from the others (a pivot below ``1e-9`` of the largest), keeps its prior
  (``from_prior``), and the samples are fitted with its prior contribution subtracted;
* fewer usable samples than parameters to fit, or a fit the step-cost checks reject:
  every parameter keeps its prior (``fell_back`` is True).

:class:`FitReport` says which parameters were fitted, the counts, and the fit's
relative error; the caller logs it once.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import Counter
from dataclasses import dataclass, field

from scoring.replay.step_cost import PARAMS, StepCost, StepCostError

#: a pivot smaller than this fraction of the largest diagonal means "not identifiable"
PIVOT_TOLERANCE = 1e-9


@dataclass(frozen=True, slots=True)
class Sample:
    """One measured probe: the summed feature rows of its steps and their seconds."""

    row: tuple[float, ...]  # order: step_cost.FEATURES
    seconds: float
    probe: str = ""  # what was measured, for the report
    source: str = ""  # "metrics" or "client"


@dataclass(slots=True)
class FitReport:
    """What :func:`fit` did: fitted parameters, counts, and the relative error."""

    cost: StepCost
    fitted: list[str] = field(default_factory=list)
    from_prior: list[str] = field(default_factory=list)
    used: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    fell_back: bool = False
    reason: str = ""
    rel_rms_error: float = 0.0  # of the used samples, 0 when nothing was fitted
    residuals: list[tuple[str, float, float]] = field(default_factory=list)  # probe, meas, pred

    def as_dict(self) -> dict[str, object]:
        return {
            "params": {p: getattr(self.cost, p) for p in PARAMS},
            "fitted": self.fitted,
            "from_prior": self.from_prior,
            "samples_used": self.used,
            "samples_rejected": dict(self.rejected),
            "fell_back_to_priors": self.fell_back,
            "reason": self.reason,
            "rel_rms_error": round(self.rel_rms_error, 4),
            "residuals": [
                {"probe": p, "measured_s": round(m, 6), "predicted_s": round(q, 6)}
                for p, m, q in self.residuals
            ],
        }


def fastest(samples: list[Sample]) -> list[Sample]:
    """The fastest valid sample of each probe (repeats of one shape share a name).

    On a machine shared with other work, contention only ever adds time to a probe, so
    the fastest repeat is the best estimate of what the engine's steps cost (as
    ``timeit`` takes the minimum).  Invalid samples are kept, to be counted by
    :func:`fit`."""
    best: dict[str, Sample] = {}
    bad: list[Sample] = []
    for s in samples:
        if _reject_reason(s) is not None:
            bad.append(s)
        elif s.probe not in best or s.seconds < best[s.probe].seconds:
            best[s.probe] = s
    return [*best.values(), *bad]


def typical(samples: list[Sample]) -> list[Sample]:
    """The median valid sample of each probe (by seconds; the lower middle of an even
    count): what the engine's steps cost under the machine's usual load, where
    :func:`fastest` estimates them unloaded.  Invalid samples are kept, to be counted."""
    by_probe: dict[str, list[Sample]] = {}
    bad: list[Sample] = []
    for s in samples:
        if _reject_reason(s) is not None:
            bad.append(s)
        else:
            by_probe.setdefault(s.probe, []).append(s)
    mids = [sorted(v, key=lambda s: s.seconds)[(len(v) - 1) // 2] for v in by_probe.values()]
    return [*mids, *bad]


def repeat_spread(samples: list[Sample]) -> float:
    """How much repeats of one probe disagree: the median over probes of (median repeat /
    fastest repeat).  1.0 on a quiet engine; well above 1 (say > 1.5) means the machine
    was busy with other work and the fit is not to be trusted.  NaN with no repeats."""
    by_probe: dict[str, list[float]] = {}
    for s in samples:
        if _reject_reason(s) is None:
            by_probe.setdefault(s.probe, []).append(s.seconds)
    ratios = [statistics.median(v) / min(v) for v in by_probe.values() if len(v) > 1]
    return statistics.median(ratios) if ratios else math.nan


def _reject_reason(s: Sample) -> str | None:
    if len(s.row) != len(PARAMS):
        return "bad_row"
    if not all(math.isfinite(x) for x in s.row) or any(x < 0 for x in s.row):
        return "bad_work"
    if not math.isfinite(s.seconds):
        return "nan_seconds"
    if s.seconds <= 0:
        return "nonpositive_seconds"
    return None


def _solve(a: list[list[float]], b: list[float]) -> tuple[list[float], list[int]]:
    """Solve ``a x = b`` (symmetric, n x n) by Gaussian elimination with partial
    pivoting; returns ``x`` and the indices whose pivot was negligible (set to 0)."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    scale = max((abs(a[i][i]) for i in range(n)), default=0.0)
    singular: list[int] = []
    cols: list[int] = []
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) <= PIVOT_TOLERANCE * scale:
            singular.append(c)
            continue
        m[c], m[p] = m[p], m[c]
        cols.append(c)
        for r in range(n):
            if r != c and m[r][c] != 0.0:
                f = m[r][c] / m[c][c]
                for k in range(c, n + 1):
                    m[r][k] -= f * m[c][k]
    x = [0.0] * n
    for c in cols:
        x[c] = m[c][n] / m[c][c]
    return x, singular


def _weighted_ls(
    rows: list[tuple[float, ...]], ys: list[float], free: list[int]
) -> tuple[list[float], list[int]]:
    """Least squares of ``ys ~ rows[:, free]`` weighted by ``1 / y`` (relative error).

    Columns are scaled to unit norm first so that seconds-per-token and seconds-per-step
    (orders of magnitude apart) condition alike."""
    w = [1.0 / y for y in ys]
    norms = [math.sqrt(sum((r[j] * wi) ** 2 for r, wi in zip(rows, w, strict=True))) for j in free]
    a = [[0.0] * len(free) for _ in free]
    b = [0.0] * len(free)
    for r, y, wi in zip(rows, ys, w, strict=True):
        z = [r[j] * wi / nj if nj > 0 else 0.0 for j, nj in zip(free, norms, strict=True)]
        for i, zi in enumerate(z):
            b[i] += zi * y * wi
            for k, zk in enumerate(z):
                a[i][k] += zi * zk
    x, singular = _solve(a, b)
    theta = [xi / nj if nj > 0 else 0.0 for xi, nj in zip(x, norms, strict=True)]
    return theta, [free[i] for i in singular]


def fit(samples: list[Sample], prior: StepCost, *, min_samples: int | None = None) -> FitReport:
    """Fit :class:`StepCost` to ``samples``; parameters the samples cannot determine
    keep ``prior``'s value (see the module docstring)."""
    report = FitReport(cost=prior)
    good: list[Sample] = []
    for s in samples:
        why = _reject_reason(s)
        if why is None:
            good.append(s)
        else:
            report.rejected[why] += 1
    report.used = len(good)
    prior_theta = [float(getattr(prior, p)) for p in PARAMS]
    free = [j for j in range(len(PARAMS)) if any(s.row[j] > 0 for s in good)]
    fixed = {j: prior_theta[j] for j in range(len(PARAMS)) if j not in free}
    prior_kept = set(fixed)
    need = len(free) if min_samples is None else max(min_samples, len(free))
    if not free or len(good) < need:
        return _fall_back(report, f"{len(good)} usable samples for {len(free)} parameters")
    rows = [s.row for s in good]
    theta = prior_theta[:]
    for _ in range(len(PARAMS) + 1):  # each pass pins at least one parameter
        ys = [s.seconds - sum(v * s.row[j] for j, v in fixed.items()) for s in good]
        if any(y <= 0 for y in ys):
            return _fall_back(report, "the priors kept alone exceed a measurement")
        est, singular = _weighted_ls(rows, ys, free)
        for j in singular:  # not identifiable: prior
            fixed[j] = prior_theta[j]
            prior_kept.add(j)
        values = dict(zip(free, est, strict=True))
        negative = [j for j in free if j not in singular and values[j] < 0]
        if singular:
            free = [j for j in free if j not in singular]
            if not free:
                return _fall_back(report, "no parameter is identifiable from the samples")
            continue
        if negative:
            worst = min(negative, key=lambda j: values[j])
            fixed[worst] = 0.0
            free = [j for j in free if j != worst]
            if not free:
                return _fall_back(report, "every fitted parameter came out negative")
            continue
        for j, v in values.items():
            theta[j] = v
        for j, v in fixed.items():
            theta[j] = v
        break
    else:  # pragma: no cover - each pass shrinks `free`
        return _fall_back(report, "the active-set fit did not converge")
    try:
        cost = StepCost(*theta).validate()
    except StepCostError as exc:
        return _fall_back(report, f"the fit is not a valid step cost: {exc}")
    if not all(math.isfinite(v) for v in theta):
        return _fall_back(report, "the fit is not finite")
    report.cost = cost
    report.from_prior = [PARAMS[j] for j in sorted(prior_kept)]
    report.fitted = [p for j, p in enumerate(PARAMS) if j not in prior_kept]
    _score(report, good)
    return report


def _score(report: FitReport, good: list[Sample]) -> None:
    c = dataclasses.astuple(report.cost)
    errs = []
    for s in good:
        pred = sum(v * x for v, x in zip(c, s.row, strict=True))
        report.residuals.append((s.probe, s.seconds, pred))
        errs.append((pred - s.seconds) / s.seconds)
    report.rel_rms_error = math.sqrt(sum(e * e for e in errs) / len(errs)) if errs else 0.0


def _fall_back(report: FitReport, reason: str) -> FitReport:
    report.fell_back = True
    report.reason = reason
    report.fitted = []
    report.from_prior = list(PARAMS)
    return report
