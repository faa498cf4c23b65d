"""Rate-limited logging: one line per cause per interval, and how many were left out.

A warning logged per request or per event (a pod's stream broke, a store failed, a bad
request) turns a flood of bad traffic into a flood of identical lines.  Through a
:class:`RateLimitedLog`, the first line of each *cause* goes out at once; further lines
of the same cause within ``interval_s`` are only counted, and the next line of that cause
logged after the interval carries the count::

    from router.logs import RateLimitedLog

    log = logging.getLogger(__name__)
    limited = RateLimitedLog(log)            # one line per cause per 10 s

    limited.warning("stream_broken", "stream from %s broke: %r", pod, exc)

    # -> stream from sim-0 broke: ReadError()
    #    (10 s later, after 9,999 more)
    # -> stream from sim-1 broke: ReadError() [9999 similar lines suppressed in the last 10.0 s]

The *cause* is any hashable key the caller picks: what the lines have in common
(``"stream_broken"``, or ``("stream_broken", pod)`` for one line per pod).  Each cause
costs one dict entry; at most ``max_causes`` are kept (the table is emptied past that,
so unbounded keys cost memory only up to the bound).  Suppressed counts of a cause that
never logs again are not reported (nothing runs on a timer); :meth:`flush` logs them on
demand.  Not thread-safe beyond what the GIL gives: meant for one event loop.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable
from typing import Any

#: seconds between two lines of one cause
DEFAULT_INTERVAL_S = 10.0
#: causes remembered at most (the table is emptied past that)
DEFAULT_MAX_CAUSES = 1024


class _Cause:
    __slots__ = ("last", "suppressed")

    def __init__(self, last: float) -> None:
        self.last = last
        self.suppressed = 0


class RateLimitedLog:
    """A logger's ``warning`` / ``error`` / ``info`` / ``exception``, at most one line per
    cause per ``interval_s`` (see the module docstring)."""

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = DEFAULT_INTERVAL_S,
        *,
        max_causes: int = DEFAULT_MAX_CAUSES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.logger = logger
        self.interval_s = interval_s
        self.max_causes = max_causes
        self._clock = clock
        self._causes: dict[Hashable, _Cause] = {}

    def log(self, level: int, cause: Hashable, msg: str, *args: Any) -> bool:
        """Log ``msg % args`` at ``level`` unless ``cause`` logged within the interval
        (then count it); True when the line went out."""
        return self._log(level, cause, msg, args, None)

    def warning(self, cause: Hashable, msg: str, *args: Any) -> bool:
        return self._log(logging.WARNING, cause, msg, args, None)

    def error(self, cause: Hashable, msg: str, *args: Any) -> bool:
        return self._log(logging.ERROR, cause, msg, args, None)

    def info(self, cause: Hashable, msg: str, *args: Any) -> bool:
        return self._log(logging.INFO, cause, msg, args, None)

    def exception(self, cause: Hashable, msg: str, *args: Any) -> bool:
        """An ERROR line with the current exception's traceback (once per interval)."""
        return self._log(logging.ERROR, cause, msg, args, True)

    def _log(
        self, level: int, cause: Hashable, msg: str, args: tuple[Any, ...], exc_info: Any
    ) -> bool:
        now = self._clock()
        entry = self._causes.get(cause)
        if entry is not None and now - entry.last < self.interval_s:
            entry.suppressed += 1
            return False
        if not self.logger.isEnabledFor(level):
            return False
        if entry is None:
            if len(self._causes) >= self.max_causes:
                self._causes.clear()
            self._causes[cause] = _Cause(now)
        else:
            if entry.suppressed:
                msg = f"{msg} [%d similar lines suppressed in the last %.1f s]"
                args = (*args, entry.suppressed, now - entry.last)
            entry.last = now
            entry.suppressed = 0
        # stacklevel: the line names the caller of warning() / log(), not this module
        self.logger.log(level, msg, *args, exc_info=exc_info, stacklevel=3)
        return True

    def suppressed(self, cause: Hashable) -> int:
        """Lines of ``cause`` counted but not logged since its last line."""
        entry = self._causes.get(cause)
        return entry.suppressed if entry is not None else 0

    def flush(self, level: int = logging.WARNING) -> None:
        """Log one line per cause with suppressed lines pending (and reset them)."""
        now = self._clock()
        for cause, entry in list(self._causes.items()):
            if entry.suppressed:
                self.logger.log(
                    level,
                    "%s: %d similar lines suppressed in the last %.1f s",
                    cause,
                    entry.suppressed,
                    now - entry.last,
                )
                entry.suppressed = 0
                entry.last = now
