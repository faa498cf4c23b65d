"""Noticing that a client went away while its request waits on a pod, cheaply: a watcher
task per attempt, started only for attempts still running after a short delay."""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from starlette.types import Receive


class Disconnected(Exception):
    pass


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


#: a disconnect watcher starts only for attempts still running after this long (most
#: short answers are in by then, and a watcher task costs more than the rest of the
#: attempt's bookkeeping); a client that leaves is noticed at most this much later
WATCH_DISCONNECT_AFTER_S = 0.02


class _Watch:
    """One attempt whose client may go away: the task running it and its ``receive``."""

    __slots__ = ("due", "gone", "receive", "task", "watcher")

    def __init__(self, task: asyncio.Task[Any], receive: Receive, due: float) -> None:
        self.task = task
        self.receive = receive
        self.due = due
        self.gone = False
        self.watcher: asyncio.Task[None] | None = None


class DisconnectWatch:
    """Cancels an attempt when its client disconnects, listening (a task reading
    ``receive`` until ``http.disconnect``) only for attempts still running after
    ``after_s``.

    One loop timer serves every attempt: it is armed for the earliest attempt due and,
    when it fires, starts the watchers of the attempts due and re-arms for the next one
    (a timer per attempt cost more than the rest of the attempt's bookkeeping).  Use::

        w = watch.begin(receive)
        try:
            ... await the upstream ...
        except asyncio.CancelledError:
            if watch.gone(w): raise Disconnected   # the client left
            raise
        finally:
            watch.end(w)
    """

    def __init__(self, after_s: float = WATCH_DISCONNECT_AFTER_S) -> None:
        self.after_s = after_s
        self._live: set[_Watch] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def begin(self, receive: Receive) -> _Watch:
        task = asyncio.current_task()
        assert task is not None
        loop = task.get_loop()
        w = _Watch(task, receive, loop.time() + self.after_s)
        self._live.add(w)
        if self._timer is None or self._loop is not loop:  # (a timer of a closed loop)
            self._loop = loop
            self._timer = loop.call_at(w.due, self._sweep, loop)
        return w

    def end(self, w: _Watch) -> None:
        self._live.discard(w)
        if w.watcher is not None:
            w.watcher.cancel()
            w.watcher = None

    def gone(self, w: _Watch) -> bool:
        """True when ``w``'s client disconnected (its task was cancelled for that; the
        cancellation is withdrawn here)."""
        if w.gone:
            w.task.uncancel()
            return True
        return False

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        now = loop.time()
        nxt: float | None = None
        for w in self._live:
            if w.watcher is not None:
                continue
            if w.due <= now:
                w.watcher = loop.create_task(_wait_disconnect(w.receive))
                w.watcher.add_done_callback(functools.partial(_on_disconnect, w))
            elif nxt is None or w.due < nxt:
                nxt = w.due
        if nxt is not None:
            self._timer = loop.call_at(nxt, self._sweep, loop)


def _on_disconnect(w: _Watch, t: asyncio.Task[None]) -> None:
    if w.watcher is not t or t.cancelled() or t.exception() is not None:
        return  # the attempt ended first (or the watcher failed)
    w.gone = True
    w.task.cancel()
