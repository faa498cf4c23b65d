"""The attempts waiting on a pod, and why one is cancelled: its client went away, its pod
was ejected or left the fleet, or its first byte is late.

An *attempt* is one try of a request on one pod, from the moment it is sent until the
first byte of its answer is about to reach the client (then it is *committed*: from
there on only a client disconnect cancels it).  :class:`AttemptWatch` tracks the live
attempts and cancels the task running one (the task's pending read raises
``CancelledError``; the transport closes the connection, so the engine aborts the
request) for one of these causes, read back with :meth:`AttemptWatch.cause`:

* ``client_disconnected`` — the client closed its connection.  Noticed by a watcher task
  reading ``receive`` until ``http.disconnect``, started only for attempts still running
  after :data:`WATCH_DISCONNECT_AFTER_S` (a task per attempt costs more than the rest of
  its bookkeeping, and most answers are in by then);
* ``first_byte_timeout`` — the attempt's first-byte deadline passed before it committed;
* ``pod_ejected`` / ``pod_removed`` — :meth:`AttemptWatch.fail_pod` (health checks ejected
  the pod, or discovery dropped it) while the attempt was not committed.

Two loop timers serve every attempt, one for the watchers due and one for the deadlines,
each armed for the earliest one and re-armed when it fires (a timer per attempt cost
more than the rest of the attempt's bookkeeping).  Use::

    a = watch.begin(receive, pod, first_byte_s)
    try:
        ... await the head ...; watch.commit(a) once a byte may go to the client ...
    except asyncio.CancelledError:
        cause = watch.cause(a)        # None: cancelled for another reason, re-raise
        ...
    finally:
        watch.end(a)
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Callable
from typing import Any, Final

from starlette.types import Receive

CLIENT_DISCONNECTED: Final = "client_disconnected"
FIRST_BYTE_TIMEOUT: Final = "first_byte_timeout"
POD_EJECTED: Final = "pod_ejected"
POD_REMOVED: Final = "pod_removed"

#: a disconnect watcher starts only for attempts still running after this long (most
#: short answers are in by then, and a watcher task costs more than the rest of the
#: attempt's bookkeeping); a client that leaves is noticed at most this much later
WATCH_DISCONNECT_AFTER_S = 0.02


class Disconnected(Exception):
    """The client went away while its request waited on a pod."""


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class Attempt:
    """One attempt: the task running it, its client's ``receive``, its pod, when its
    disconnect watcher is due and its first-byte deadline (loop time; inf: none)."""

    __slots__ = ("committed", "deadline", "due", "pod", "reason", "receive", "task", "watcher")

    def __init__(
        self, task: asyncio.Task[Any], receive: Receive, pod: str, due: float, deadline: float
    ) -> None:
        self.task = task
        self.receive = receive
        self.pod = pod
        self.due = due
        self.deadline = deadline
        self.committed = False
        #: why the task was cancelled (None: it was not, by this watch)
        self.reason: str | None = None
        self.watcher: asyncio.Task[None] | None = None


class AttemptWatch:
    """Cancels live attempts for their client, their pod or their deadline (see the
    module docstring)."""

    def __init__(self, after_s: float = WATCH_DISCONNECT_AFTER_S) -> None:
        self.after_s = after_s
        self._live: set[Attempt] = set()
        # two lazily armed timers, one for the watchers due and one for the deadlines:
        # each kind comes due in the order attempts began (the delays are constant),
        # so neither is re-armed per attempt
        self._watchers = _Timer(self._start_watchers)
        self._deadlines = _Timer(self._expire)

    def __len__(self) -> int:
        return len(self._live)

    def begin(self, receive: Receive, pod: str, first_byte_s: float | None = None) -> Attempt:
        """Watch the current task's attempt on ``pod``; ``first_byte_s``: cancel it
        (``first_byte_timeout``) unless committed within that many seconds."""
        task = asyncio.current_task()
        assert task is not None
        loop = task.get_loop()
        now = loop.time()
        deadline = math.inf if first_byte_s is None else now + first_byte_s
        a = Attempt(task, receive, pod, now + self.after_s, deadline)
        self._live.add(a)
        self._watchers.at(loop, a.due)
        if first_byte_s is not None:
            self._deadlines.at(loop, deadline)
        return a

    def commit(self, a: Attempt) -> None:
        """A byte of the answer may reach the client now: from here on only the client's
        disconnect cancels the attempt (no failover, no first-byte deadline)."""
        a.committed = True

    def end(self, a: Attempt) -> None:
        self._live.discard(a)
        if a.watcher is not None:
            a.watcher.cancel()
            a.watcher = None

    def cause(self, a: Attempt) -> str | None:
        """Why ``a``'s task was cancelled by this watch (the cancellation is withdrawn
        then), or None when it was cancelled for something else."""
        if a.reason is not None:
            a.task.uncancel()
        return a.reason

    def fail_pod(self, pod: str, reason: str) -> int:
        """Cancel the uncommitted attempts on ``pod`` with ``reason``; how many."""
        n = 0
        for a in list(self._live):
            if a.pod == pod and not a.committed and _cancel(a, reason):
                n += 1
        return n

    def _start_watchers(self, loop: asyncio.AbstractEventLoop, now: float) -> float:
        nxt = math.inf
        for a in self._live:
            if a.watcher is not None or a.reason is not None:
                continue
            if a.due <= now:
                a.watcher = loop.create_task(_wait_disconnect(a.receive))
                a.watcher.add_done_callback(functools.partial(_on_disconnect, a))
            elif a.due < nxt:
                nxt = a.due
        return nxt

    def _expire(self, loop: asyncio.AbstractEventLoop, now: float) -> float:
        nxt = math.inf
        for a in list(self._live):
            if a.committed or a.reason is not None or a.deadline == math.inf:
                continue
            if a.deadline <= now:
                _cancel(a, FIRST_BYTE_TIMEOUT)
            elif a.deadline < nxt:
                nxt = a.deadline
        return nxt


class _Timer:
    """One loop timer armed for the earliest of the times asked (:meth:`at`); when it
    fires, ``fire(loop, now)`` does what is due and returns when it is next needed."""

    __slots__ = ("_at", "_fire", "_handle", "_loop")

    def __init__(self, fire: Callable[[asyncio.AbstractEventLoop, float], float]) -> None:
        self._fire = fire
        self._handle: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._at = math.inf

    def at(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._handle is not None and self._loop is loop and when >= self._at:
            return  # armed early enough (the common case: no timer operation)
        if self._handle is not None:
            self._handle.cancel()
        self._arm(loop, when)

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        self._loop = loop
        self._at = when
        self._handle = loop.call_at(when, self._run, loop)

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        self._handle = None
        self._at = math.inf
        nxt = self._fire(loop, loop.time())
        if nxt < math.inf:
            self._arm(loop, nxt)


def _cancel(a: Attempt, reason: str) -> bool:
    if a.reason is not None or a.task.done():
        return False
    a.reason = reason
    a.task.cancel()
    return True


def _on_disconnect(a: Attempt, t: asyncio.Task[None]) -> None:
    if a.watcher is not t or t.cancelled() or t.exception() is not None:
        return  # the attempt ended first (or the watcher failed)
    _cancel(a, CLIENT_DISCONNECTED)
