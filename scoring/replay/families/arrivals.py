"""Arrival processes: when each unit of a family (a session, a conversation, a request)
starts.  All draw from the ``random.Random`` they are given, so a trace is a function of
its seed.

* :class:`Poisson` — exponential gaps at ``rate_per_s`` (coefficient of variation 1).
* :class:`OnOff` — bursts: a two-state Markov-modulated Poisson process.  ON periods
  (exponential, mean ``mean_on_s``) emit at ``rate_per_s * (mean_on_s + mean_off_s) /
  mean_on_s``, OFF periods (exponential, mean ``mean_off_s``) emit nothing, so the
  long-run rate is ``rate_per_s`` and the gaps' coefficient of variation is > 1.
* :class:`Gamma` — a renewal process with gamma gaps of mean ``1 / rate_per_s`` and
  coefficient of variation ``cv`` (BurstGPT, arXiv:2401.17644, fits Azure OpenAI
  arrivals with gamma gaps; ``cv > 1`` is bursty).

Only the *shape* of a process survives :func:`scoring.replay.offered_load.scale_to_load`,
which rescales every time in a trace: a burst keeps its number of requests, and
``rate_per_s`` only sets the time unit before scaling.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Protocol


class Arrivals(Protocol):
    def times(self, n: int, rng: random.Random) -> list[float]:
        """``n`` non-decreasing start times from 0."""
        ...


def _check_positive(**values: float) -> None:
    for name, v in values.items():
        if not (v > 0 and math.isfinite(v)):
            raise ValueError(f"{name} must be > 0, got {v!r}")


@dataclass(frozen=True)
class Poisson:
    rate_per_s: float = 1.0

    def times(self, n: int, rng: random.Random) -> list[float]:
        _check_positive(rate_per_s=self.rate_per_s)
        t = 0.0
        out: list[float] = []
        for _ in range(n):
            out.append(t)
            t += rng.expovariate(self.rate_per_s)
        return out


@dataclass(frozen=True)
class OnOff:
    rate_per_s: float = 1.0
    mean_on_s: float = 10.0
    mean_off_s: float = 40.0

    def times(self, n: int, rng: random.Random) -> list[float]:
        _check_positive(
            rate_per_s=self.rate_per_s, mean_on_s=self.mean_on_s, mean_off_s=self.mean_off_s
        )
        on_rate = self.rate_per_s * (self.mean_on_s + self.mean_off_s) / self.mean_on_s
        t = 0.0
        out: list[float] = []
        while len(out) < n:
            end = t + rng.expovariate(1.0 / self.mean_on_s)
            while len(out) < n:
                t += rng.expovariate(on_rate)
                if t > end:
                    break
                out.append(t)
            t = end + rng.expovariate(1.0 / self.mean_off_s)
        first = out[0] if out else 0.0
        return [x - first for x in out]


@dataclass(frozen=True)
class Gamma:
    rate_per_s: float = 1.0
    cv: float = 2.0

    def times(self, n: int, rng: random.Random) -> list[float]:
        _check_positive(rate_per_s=self.rate_per_s, cv=self.cv)
        shape = 1.0 / (self.cv * self.cv)
        scale = 1.0 / (self.rate_per_s * shape)
        t = 0.0
        out: list[float] = []
        for _ in range(n):
            out.append(t)
            t += rng.gammavariate(shape, scale)
        return out


def interarrival_cv(times: Sequence[float]) -> float:
    """Coefficient of variation (std / mean) of the gaps between sorted ``times``."""
    xs = sorted(times)
    gaps = [b - a for a, b in pairwise(xs)]
    if len(gaps) < 2:
        return 0.0
    mean = sum(gaps) / len(gaps)
    if mean <= 0:
        return 0.0
    var = sum((g - mean) ** 2 for g in gaps) / (len(gaps) - 1)
    return math.sqrt(var) / mean
