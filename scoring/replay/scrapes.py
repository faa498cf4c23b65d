"""What the router's scrapes show of a pod, in virtual time.

Live, a pod's ``waiting``, ``running`` and ``kv_usage`` reach the policy from its
``/metrics``, scraped every ``scrape.interval_s`` (1 s by default): a decision sees them
as they were at the last scrape.  The replay's pods know them exactly at each decision.
Policies that weigh them (``precise_prefix``, ``llmd``, ``measured``; ``cost`` in its room
tie-break) can decide differently on the two, so the replay can show them as a scrape
would: :class:`Scrapes` keeps, per pod, the values of the first decision at or after each
scrape instant (multiples of the interval from the trace's start) and hands every later
decision those until the next instant.  The router-tracked load (``inflight``,
``outstanding_prefill_tokens``) and the index hits are not scraped and stay exact.
"""

from __future__ import annotations

from dataclasses import replace

from scoring.policies.base import PodView


class Scrapes:
    """``interval_s`` > 0: scraped fields as of the last scrape; 0: exact (no copy)."""

    def __init__(self, interval_s: float, start_s: float = 0.0) -> None:
        if not interval_s >= 0.0:  # also NaN
            raise ValueError(f"scrape interval must be >= 0 s, got {interval_s!r}")
        self.interval_s = interval_s
        self._start = start_s
        #: pod -> (scrape instant, waiting, running, kv_usage)
        self._last: dict[str, tuple[float, int | None, int | None, float | None]] = {}

    def views(self, now: float, views: list[PodView]) -> list[PodView]:
        step = self.interval_s
        if step <= 0.0:
            return views
        instant = self._start + ((now - self._start) // step) * step
        last = self._last
        out = []
        for v in views:
            seen = last.get(v.pod)
            if seen is None or seen[0] < instant:  # a scrape happened since the last one
                last[v.pod] = (instant, v.waiting, v.running, v.kv_usage)
                out.append(v)
            else:
                out.append(replace(v, waiting=seen[1], running=seen[2], kv_usage=seen[3]))
        return out
