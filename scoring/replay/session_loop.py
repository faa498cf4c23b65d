"""When each request of a replayed trace arrives: at its planned time, or, for a
session's later turns, after the answer to its previous turn (a closed loop).

A trace plans every request's arrival.  The generated families plan a session's turns
as the previous turn's planned arrival plus the client's think time (an agent's tool
run, a user reading and typing), as if answers took no time
(scoring/replay/families/).  Replayed *open* (the default, and the only mode before
session 37), every request arrives at its planned time whatever the fleet does, so on a
slow pod an agent's next turn can arrive while its previous one still waits for its
first token.  No agent does that: it sends the next turn when it has the answer.  On a
fleet that falls behind, the open replay piles a session's turns into one pod's queue,
each one needing room for the whole context at once.

*Closed*: a session's first request arrives at its planned time; each later turn
arrives the planned gap after the answer to the turn before it ends (its last token,
or its refusal)::

    arrival[next] = end[previous] + (planned[next] - planned[previous])

Requests without a session arrive as planned.  The planned gap is the think time only
where the plan assumed instant answers, as the generated families do; a recorded trace
whose timestamps already include its original answers' time would count that time
twice, so closed replay is meant for generated sessions.  A slow fleet slows its own
sessions, as a closed-loop client would: the offered load then falls below the plan's.

The event loops (scoring/replay/engine.py, scoring/replay/vllm_loop.py) take arrivals
from :class:`Arrivals` in time order; with closed sessions an arrival can appear while
pods run, so a pod's decode run may not outlast :meth:`Arrivals.horizon`: the next
planned arrival, or the earliest instant a turn not yet scheduled could arrive (now
plus the shortest planned gap).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence

from scoring.replay.trace import TraceRequest

SESSION_MODES = ("open", "closed")


class Arrivals:
    """The arrivals of ``requests`` (trace order, by planned time) under ``mode``.
    ``at[i]``: request ``i``'s arrival (planned until it is scheduled)."""

    __slots__ = ("_closed", "_heap", "_min_gap", "_pending", "_seq", "at", "gap", "next_of")

    def __init__(self, requests: Sequence[TraceRequest], mode: str = "open") -> None:
        if mode not in SESSION_MODES:
            raise ValueError(f"sessions must be one of {', '.join(SESSION_MODES)}, got {mode!r}")
        self.at = [r.arrival_s for r in requests]
        #: request -> the index of its session's next turn (-1: none, or open mode)
        self.next_of = [-1] * len(requests)
        #: request -> the planned gap after the turn before it (its think time)
        self.gap = [0.0] * len(requests)
        self._heap: list[tuple[float, int]] = []
        self._seq = 0  # open mode: the next request in trace order
        self._pending = 0  # closed mode: later turns whose previous turn has not ended
        self._min_gap = math.inf
        closed = mode == "closed"
        last: dict[str, int] = {}
        follows = [False] * len(requests)
        if closed:
            for i, r in enumerate(requests):
                session = r.route.session
                if session is None:
                    continue
                prev = last.get(session)
                last[session] = i
                if prev is not None:
                    self.next_of[prev] = i
                    gap = self.gap[i] = max(0.0, r.arrival_s - requests[prev].arrival_s)
                    self._min_gap = min(self._min_gap, gap)
                    follows[i] = True
                    self._pending += 1
            self._heap = [(self.at[i], i) for i in range(len(requests)) if not follows[i]]
            heapq.heapify(self._heap)
        self._closed = closed

    def next_time(self) -> float:
        """The next arrival known now (``inf``: none yet, or none left)."""
        if self._closed:
            return self._heap[0][0] if self._heap else math.inf
        return self.at[self._seq] if self._seq < len(self.at) else math.inf

    def pop(self) -> int:
        """The next arrival's request (call only when :meth:`next_time` is finite)."""
        if self._closed:
            return heapq.heappop(self._heap)[1]
        i = self._seq
        self._seq += 1
        return i

    def ended(self, i: int, now: float) -> None:
        """Request ``i``'s answer ended (or it was refused) at ``now``: its session's
        next turn arrives its planned gap later."""
        j = self.next_of[i]
        if j >= 0:
            self.next_of[i] = -1
            self._pending -= 1
            t = self.at[j] = now + self.gap[j]
            heapq.heappush(self._heap, (t, j))

    def horizon(self, now: float) -> float:
        """No arrival comes before this: the next known one, or, while later turns wait
        for their previous turn's end (which is at least ``now``), ``now`` plus the
        shortest planned gap."""
        t = self.next_time()
        if self._pending:
            soonest = now + self._min_gap
            if soonest < t:
                return soonest
        return t
