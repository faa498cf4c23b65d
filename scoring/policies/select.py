"""Choosing among candidates: the selection steps several policies share.

* :func:`require_candidates` — a policy asked to pick among zero pods raises
  :class:`~scoring.policies.base.NoCandidatesError` naming itself.
* :func:`draw` — the only candidate, or one drawn uniformly with the policy's seeded
  RNG.  A single candidate consumes no random number, so a policy's sequence of draws
  (and therefore a replay) depends only on the decisions that really were ties.
* :func:`lowest` / :func:`highest` — the candidates whose key equals the minimum
  (maximum), and :func:`draw` among them: ties never favour the first candidate.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any, TypeVar

from scoring.policies.base import NoCandidatesError

T = TypeVar("T")


def require_candidates(policy: str, pods: Sequence[object]) -> None:
    """Raise :class:`NoCandidatesError` (``"<policy>: no candidate pods"``) when empty."""
    if not pods:
        raise NoCandidatesError(f"{policy}: no candidate pods")


def draw(candidates: Sequence[T], rng: random.Random) -> T:
    """``candidates[0]`` when it is alone, else ``rng.choice(candidates)``."""
    return candidates[0] if len(candidates) == 1 else rng.choice(candidates)


def lowest(candidates: Sequence[T], keys: Sequence[Any], rng: random.Random) -> tuple[T, int]:
    """Draw among the candidates whose key (``keys[i]`` for ``candidates[i]``) is the
    smallest; returns the chosen candidate and how many were tied."""
    best = min(keys)
    tied = [c for c, k in zip(candidates, keys, strict=True) if k == best]
    return draw(tied, rng), len(tied)


def highest(candidates: Sequence[T], keys: Sequence[Any], rng: random.Random) -> tuple[T, int]:
    """Draw among the candidates whose key is the largest (see :func:`lowest`)."""
    best = max(keys)
    tied = [c for c, k in zip(candidates, keys, strict=True) if k == best]
    return draw(tied, rng), len(tied)
