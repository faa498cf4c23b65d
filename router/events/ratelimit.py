"""Rate-limited log lines for the KV-event path: one line per cause per interval.

A publisher that sends garbage at 20,000 messages a second must not write 20,000 log
lines.  :func:`limited` is the event path's short spelling of
:class:`router.logs.RateLimitedLog` (one limiter per logger, shared by every caller of
that logger): the first line of a ``key`` (a cause, usually ``"<what>:<pod>"``) goes out
at once, repeats within 10 s are counted, and the next line carries the count.  The
counters in :mod:`router.events.stats` count every occurrence; the log is for humans.
"""

from __future__ import annotations

import logging
from typing import Any

from router.logs import RateLimitedLog

_limiters: dict[str, RateLimitedLog] = {}


def limited(
    logger: logging.Logger, key: str, msg: str, *args: Any, level: int = logging.WARNING
) -> bool:
    """``logger.log(level, msg, *args)`` unless ``key`` logged less than 10 s ago;
    returns whether the line was written."""
    limiter = _limiters.get(logger.name)
    if limiter is None:
        limiter = _limiters[logger.name] = RateLimitedLog(logger)
    return limiter.log(level, key, msg, *args)


def reset() -> None:
    """Forget every key (tests)."""
    _limiters.clear()
