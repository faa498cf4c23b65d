"""Collects a family's requests into the :class:`~scoring.replay.trace.Trace` the replay reads.

Session families (agentic, chat) keep only a *steady window* of their sessions: sessions
start at a constant mean rate, so the number in flight ramps up for about a session's
lifetime, and falls once the last one has started.  The window runs from ``warmup``
after the first start (``warmup`` = the ``warmup_quantile`` of session durations: by then
at least that share of the steady population is in flight) to the last start, as a trace
captured from a running service would: sessions already running when it opens show up
mid-way, with a context no earlier request had.
"""

from __future__ import annotations

from typing import NamedTuple

from scoring.policies.base import RouteRequest
from scoring.replay.families.context import Context
from scoring.replay.trace import Trace, TraceRequest, link_answers


class _Row(NamedTuple):
    arrival_s: float
    order: int
    tokens: int
    keys: list[int]
    output_tokens: int
    session: str | None
    turns: int | None


class TraceBuilder:
    """Requests in any order -> a trace sorted by arrival, ids ``r0, r1, ...`` in
    arrival order (ties keep the order they were added in)."""

    def __init__(self, family: str, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.family = family
        self.block_size = block_size
        self._rows: list[_Row] = []

    def context(self) -> Context:
        """An empty prompt keyed for this trace."""
        return Context(self.block_size, model=self.family)

    def add(
        self,
        arrival_s: float,
        prompt: Context,
        output_tokens: int,
        *,
        session: str | None = None,
        turns: int | None = None,
    ) -> None:
        """Add a request whose prompt is ``prompt`` as it stands now."""
        tokens, keys = prompt.snapshot()
        self._rows.append(
            _Row(arrival_s, len(self._rows), max(1, tokens), keys, output_tokens, session, turns)
        )

    def build(self, window: tuple[float, float] | None = None) -> Trace:
        """The trace; with ``window = (a, b)`` only the requests arriving in ``[a, b]``,
        times shifted so the first is at 0."""
        rows = sorted(self._rows, key=lambda r: (r.arrival_s, r.order))
        if window is not None:
            a, b = window
            rows = [r for r in rows if a <= r.arrival_s <= b]
            if not rows:
                raise ValueError(f"no request of {self.family!r} arrives in {window}")
            t0 = rows[0].arrival_s
            rows = [r._replace(arrival_s=r.arrival_s - t0) for r in rows]
        requests = []
        for i, r in enumerate(rows):
            route = RouteRequest(
                request_id=f"r{i}",
                model=self.family,
                prompt_tokens=r.tokens,
                block_keys=r.keys,
                block_size=self.block_size,
                session=r.session,
                max_tokens=r.output_tokens,
            )
            requests.append(
                TraceRequest(
                    arrival_s=r.arrival_s,
                    output_tokens=r.output_tokens,
                    route=route,
                    turns=r.turns,
                )
            )
        link_answers(requests)  # each step's output is appended to its context next
        return Trace(
            requests=requests,
            block_size=self.block_size,
            fmt=f"synthetic:{self.family}",
            lines=len(requests),
        )


def steady_window(
    sessions: list[tuple[float, float]], warmup_quantile: float
) -> tuple[float, float]:
    """``(a, b)`` for sessions given as ``(start, last arrival)``: ``a`` = first start +
    the ``warmup_quantile`` of durations (0: the first start), ``b`` = the last start."""
    if not 0.0 <= warmup_quantile < 1.0:
        raise ValueError(f"warmup_quantile must be in [0, 1), got {warmup_quantile}")
    starts = sorted(s for s, _ in sessions)
    durations = sorted(e - s for s, e in sessions)
    warmup = durations[int(warmup_quantile * (len(durations) - 1))] if warmup_quantile else 0.0
    a, b = starts[0] + warmup, starts[-1]
    if a >= b:
        raise ValueError(
            f"{len(sessions)} sessions are too few for a steady window: their starts span "
            f"{b - starts[0]:.0f} s, less than the {warmup:.0f} s warm-up; raise the number "
            "of sessions or lower warmup_quantile"
        )
    return a, b
