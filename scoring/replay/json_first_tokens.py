"""JSON answers in the replay: the first tokens the router does not see, and the pods'
counts of them that it scrapes.

A request whose client asks for a JSON answer (``json_share``) reports no first token
to the policy (:func:`scoring.replay.engine.json_answers`).  Live, the router learns
that its prefill is done from the pod's ``vllm:time_to_first_token_seconds_count``
(:mod:`scoring.unseen_first_tokens`), scraped every ``scrape.interval_s``.  The replay
plays that with the same code: each pod counts its first tokens and its finished
requests as vLLM does, and at each scrape instant (multiples of the interval from the
trace's start; the live default, 1 s, when the replay's views are exact) the pending
JSON requests the counts show past their first token are released: the load's
outstanding prefill drops and the policy hears ``on_prefill_done``.
"""

from __future__ import annotations

import math

from scoring.unseen_first_tokens import UnseenFirstTokens

#: ``scrape.interval_s``'s default (router/config_sections.py): the counts' cadence
#: when the replay's views are exact
LIVE_SCRAPE_S = 1.0


class JsonFirstTokens:
    """The router's accounting of unseen first tokens and the pods' counts, in virtual
    time, for one replay."""

    __slots__ = ("_counts", "_gap", "_interval", "_json", "_start", "next_at")

    def __init__(self, json_of: list[bool], pods: list[str], start_s: float, interval_s: float):
        self._json = json_of
        self._gap: UnseenFirstTokens[int] = UnseenFirstTokens()
        #: pod -> [first tokens, finished requests]: the engine's counters
        self._counts = {p: [0, 0] for p in pods}
        self._interval = interval_s if interval_s > 0.0 else LIVE_SCRAPE_S
        self._start = start_s
        #: the next scrape instant
        self.next_at = start_s
        for pod in pods:  # a router scrapes each pod as it registers it: before any request
            self._gap.scraped(pod, 0.0, 0.0)

    def routed(self, pod: str, ri: int) -> None:
        self._gap.started(pod)
        if self._json[ri]:
            self._gap.expect(pod, ri)

    def first_token(self, pod: str, ri: int) -> None:
        self._counts[pod][0] += 1
        if not self._json[ri]:
            self._gap.seen(pod)

    def finished(self, pod: str, ri: int) -> bool:
        """The request ended; True when its prompt is still the load's outstanding
        prefill (a JSON request no scrape released)."""
        self._counts[pod][1] += 1
        return self._gap.ended(pod, ri if self._json[ri] else None)

    def scrape(self, now: float) -> list[tuple[str, int]]:
        """The scrape at ``now`` (== :attr:`next_at`): (pod, request) released, oldest
        first per pod."""
        self.next_at = now + self._interval
        out: list[tuple[str, int]] = []
        for pod, (first, done) in self._counts.items():
            out.extend((pod, ri) for ri in self._gap.scraped(pod, float(first), float(done)))
        return out

    def skip_to(self, now: float) -> None:
        """Move the next instant past ``now`` (instants in an idle spell release
        nothing: no pod had work)."""
        if self.next_at < now < math.inf:
            k = math.ceil((now - self._start) / self._interval)
            self.next_at = self._start + k * self._interval
