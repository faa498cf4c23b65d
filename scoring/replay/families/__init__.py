"""Seeded generators of synthetic traffic families, as :class:`~scoring.replay.trace.Trace`\\ s.

Each family is a module with a frozen ``Params`` dataclass (every knob with a documented
default and its source) and ``generate(params, seed) -> Trace``; the same seed gives the
same trace, request for request.  Prompts are chains of block keys built from segments
(:mod:`.context`), so prefix sharing is exact at ``block_size`` granularity.

* ``agentic`` — coding-agent sessions: tens of tool-loop steps over a growing context,
  shared system prompts, compaction, think time (:mod:`.agentic`).
* ``rag`` — short questions over a few long shared documents (:mod:`.rag`).
* ``chat`` — multi-turn chats with a few shared system prompts (:mod:`.chat`).
* ``mixed`` — mostly short prompts, some long ones, little reuse (:mod:`.mixed`).

Any family takes any arrival process for its units (:mod:`.arrivals`: Poisson, on-off
bursts, gamma); :func:`bursty` swaps a family's Poisson starts for on-off bursts of the
same mean rate.  Times are in seconds from 0; the offered load is set afterwards by
:func:`scoring.replay.offered_load.scale_to_load`.

    >>> from scoring.replay.families import generate
    >>> trace = generate("rag", seed=1, requests=200, block_size=64)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from scoring.replay.families import agentic, chat, mixed, rag
from scoring.replay.families.arrivals import Gamma, OnOff, Poisson, interarrival_cv
from scoring.replay.trace import Trace

#: family name -> (its parameter class, its generator)
FAMILIES: dict[str, tuple[type[Any], Callable[[Any, int], Trace]]] = {
    "agentic": (agentic.AgenticParams, agentic.generate),
    "rag": (rag.RagParams, rag.generate),
    "chat": (chat.ChatParams, chat.generate),
    "mixed": (mixed.MixedParams, mixed.generate),
}


def family_params(name: str, **overrides: Any) -> Any:
    """The ``Params`` of family ``name`` with ``overrides`` applied (unknown names and
    fields raise ``ValueError`` naming them)."""
    if name not in FAMILIES:
        raise ValueError(f"unknown family {name!r}; available: {', '.join(FAMILIES)}")
    cls = FAMILIES[name][0]
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"family {name!r} has no parameter {', '.join(unknown)}")
    return cls(**overrides).validate()


def generate(name: str, seed: int, **overrides: Any) -> Trace:
    """A trace of family ``name`` for ``seed``, with parameter ``overrides``."""
    params = family_params(name, **overrides)
    return FAMILIES[name][1](params, seed)


def bursty(params: Any, *, mean_on_s: float = 10.0, mean_off_s: float = 40.0) -> Any:
    """``params`` with on-off bursts of the same mean rate as its arrival process.

    Defaults: bursts at 5x the mean rate for 20% of the time (an assumption: the shape
    survives load scaling, the durations do not matter alone)."""
    rate = params.arrivals.rate_per_s
    return dataclasses.replace(
        params, arrivals=OnOff(rate_per_s=rate, mean_on_s=mean_on_s, mean_off_s=mean_off_s)
    )


__all__ = [
    "FAMILIES",
    "Gamma",
    "OnOff",
    "Poisson",
    "bursty",
    "family_params",
    "generate",
    "interarrival_cv",
]
