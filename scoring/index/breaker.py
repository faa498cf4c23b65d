"""A circuit breaker for a shared store: fail at once while the store is down.

A router replica that waits on a dead Redis for every request fails every request; one
that stops asking after a few failures routes on what it has (its own load counts, the
prefixes it routed for cache hits) until the store is back.  :class:`CircuitBreaker` is
that switch, one per Redis URL of a process, shared by every store using that URL
(:class:`scoring.index.redis_guard.RedisGuard` holds it):

* **closed** -- calls go through.  ``failures_to_open`` consecutive failures (a
  timeout, a refused or reset connection, a server saying it is loading or busy) open
  it; a success resets the count.  An answer that is an error of the request itself
  (``kind`` "error": READONLY, OOM, a script error) proves the server is there: it
  counts as a success here.
* **open** -- every call fails at once with :class:`SharedStateUnavailable` (``kind``
  "open") without touching the network, for a backoff that grows with each opening in
  a row: exponential with equal jitter (half fixed, half random), capped
  (``redis.backoff.EqualJitterBackoff``: 0.25-0.5 s, 0.5-1 s, ... up to 2.5-5 s by
  default).  The jitter keeps the replicas of a fleet from probing a recovering server
  in step.
* **half-open** -- after the backoff, one call (the *probe*) goes through; the others
  still fail at once.  The probe's success closes the breaker (and resets the backoff);
  its failure opens it again with the next, longer backoff.  A probe that ends with no
  verdict (cancelled, or an error that is not the store's) frees the probe slot.

State for metrics: :attr:`~CircuitBreaker.state`, :attr:`~CircuitBreaker.is_open`,
:attr:`~CircuitBreaker.degraded` (the ``kvroute_redis_degraded`` gauge's value),
:attr:`~CircuitBreaker.errors` (counts by ``(op, kind)``), and :meth:`~CircuitBreaker.
listen` for callbacks on every error and every change of state.

Why not a library: pybreaker is synchronous (its async path needs Tornado), aiobreaker
is unmaintained since 2021, and purgatory and circuitbreaker reopen after a fixed delay
without jitter; none counts errors by operation and kind.  The backoff itself is
redis-py's.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Literal, Protocol

from redis.backoff import EqualJitterBackoff

__all__ = [
    "ERROR_KINDS",
    "CircuitBreaker",
    "SharedStateUnavailable",
]

log = logging.getLogger(__name__)

#: ``kind`` of an error: ``timeout`` (the call's deadline passed), ``connection``
#: (refused, reset, closed), ``server`` (the server answered LOADING, BUSY,
#: MASTERDOWN, TRYAGAIN or CLUSTERDOWN: it cannot serve now), ``error`` (any other error
#: reply: READONLY, OOM, a script error -- the server is up), ``open`` (refused by the
#: open breaker without a call).
ERROR_KINDS: tuple[str, ...] = ("timeout", "connection", "server", "error", "open")

#: the kinds that count as a failure of the store (open the breaker)
_FAILURES = frozenset({"timeout", "connection", "server"})

State = Literal["closed", "open", "half_open"]


class SharedStateUnavailable(Exception):
    """The shared store could not serve this call now; the caller falls back.

    ``op`` names the operation (``lookup``, ``load_snapshot``, ``owner_get``...),
    ``kind`` is one of :data:`ERROR_KINDS`; the store's own exception, if any, is the
    ``__cause__``.
    """

    def __init__(self, op: str, kind: str, detail: str = "") -> None:
        self.op = op
        self.kind = kind
        msg = f"shared state unavailable for {op} ({kind})"
        super().__init__(f"{msg}: {detail}" if detail else msg)


class Backoff(Protocol):
    """Seconds to wait after the ``failures``-th opening in a row (redis-py's backoffs)."""

    def compute(self, failures: int) -> float: ...


ErrorListener = Callable[[str, str], None]
StateListener = Callable[[str], None]


class CircuitBreaker:
    """Closed / open / half-open switch for one shared store (see the module docstring).

    ``failures_to_open`` -- consecutive failures that open it; ``backoff`` -- delay
    before the probe after the n-th opening in a row (default: equal jitter, 0.25 s
    base, 5 s cap); ``clock`` -- monotonic seconds (a test may pass its own).
    """

    def __init__(
        self,
        *,
        name: str = "redis",
        failures_to_open: int = 5,
        backoff: Backoff | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not isinstance(failures_to_open, int) or failures_to_open < 1:
            raise ValueError(f"failures_to_open must be an int >= 1, got {failures_to_open!r}")
        self.name = name
        self.failures_to_open = failures_to_open
        self.backoff: Backoff = backoff or EqualJitterBackoff(cap=5.0, base=0.25)
        self._clock = clock
        self._state: State = "closed"
        self._consecutive = 0
        #: openings in a row without a successful probe in between (sets the backoff)
        self._openings = 0
        self._retry_at = 0.0
        self._probing = False
        #: errors so far by (op, kind), including calls refused while open
        self.errors: Counter[tuple[str, str]] = Counter()
        #: times the breaker opened
        self.opened = 0
        self._on_error: list[ErrorListener] = []
        self._on_state: list[StateListener] = []

    # -- state ------------------------------------------------------------------------

    @property
    def state(self) -> State:
        return self._state

    @property
    def is_open(self) -> bool:
        """True unless closed: calls fail at once (but for the half-open probe)."""
        return self._state != "closed"

    @property
    def degraded(self) -> int:
        """1 while not closed, else 0: the value of ``kvroute_redis_degraded``."""
        return 0 if self._state == "closed" else 1

    def errors_by_kind(self) -> Counter[str]:
        """Errors so far summed over operations."""
        out: Counter[str] = Counter()
        for (_op, kind), n in self.errors.items():
            out[kind] += n
        return out

    def retry_in(self) -> float:
        """Seconds until the next probe may go (0 when closed or due)."""
        if self._state == "closed":
            return 0.0
        return max(0.0, self._retry_at - self._clock())

    def listen(
        self, *, on_error: ErrorListener | None = None, on_state: StateListener | None = None
    ) -> Callable[[], None]:
        """Call ``on_error(op, kind)`` on every error (refusals while open included) and
        ``on_state(state)`` on every change of state; returns a function that removes
        them.  Listeners run synchronously in the caller's task: keep them cheap (a
        Prometheus counter, a gauge); one that raises is logged and ignored."""
        if on_error is not None:
            self._on_error.append(on_error)
        if on_state is not None:
            self._on_state.append(on_state)

        def remove() -> None:
            if on_error is not None and on_error in self._on_error:
                self._on_error.remove(on_error)
            if on_state is not None and on_state in self._on_state:
                self._on_state.remove(on_state)

        return remove

    # -- the calls' side ----------------------------------------------------------------

    def admit(self, op: str) -> bool:
        """Before a call: returns True for the probe of a half-open breaker, False for a
        call of a closed one; raises :class:`SharedStateUnavailable` (kind "open") when
        the call must not go.  A probe must end with :meth:`success`, :meth:`failure` or
        :meth:`abandon`."""
        if self._state == "closed":
            return False
        if not self._probing and self._clock() >= self._retry_at:
            self._probing = True
            self._set("half_open")
            return True
        self._count(op, "open")
        raise SharedStateUnavailable(
            op, "open", f"{self.name} is failing; next probe in {self.retry_in():.2f}s"
        )

    def success(self, probe: bool = False) -> None:
        """The call got an answer from the store."""
        self._consecutive = 0
        if probe:
            self._probing = False
            self._openings = 0
            self._set("closed")
        # a late success of a call sent before the breaker opened proves little: the
        # breaker stays open until its probe answers

    def failure(self, op: str, kind: str, probe: bool = False) -> None:
        """The call failed with ``kind`` (one of :data:`ERROR_KINDS` but "open")."""
        self._count(op, kind)
        if kind not in _FAILURES:
            self.success(probe)
            return
        self._consecutive += 1
        if probe:
            self._probing = False
            self._open()
        elif self._state == "closed" and self._consecutive >= self.failures_to_open:
            self._open()

    def abandon(self, probe: bool) -> None:
        """The call ended with no verdict (cancelled; a bug outside the store)."""
        if probe:
            self._probing = False
            self._set("open")

    # -- internals ----------------------------------------------------------------------

    def _open(self) -> None:
        self._openings += 1
        self.opened += 1
        delay = self.backoff.compute(self._openings)
        self._retry_at = self._clock() + delay
        if self._state == "closed":
            log.warning(
                "%s: %d failures in a row: failing fast, first probe in %.2fs",
                self.name,
                self._consecutive,
                delay,
            )
        self._set("open")

    def _set(self, state: State) -> None:
        if state == self._state:
            return
        was = self._state
        self._state = state
        if state == "closed":
            log.warning("%s: back (was %s)", self.name, was)
        for cb in list(self._on_state):
            try:
                cb(state)
            except Exception:
                log.exception("%s: state listener failed", self.name)

    def _count(self, op: str, kind: str) -> None:
        self.errors[(op, kind)] += 1
        for cb in list(self._on_error):
            try:
                cb(op, kind)
            except Exception:
                log.exception("%s: error listener failed", self.name)
