"""Rate-limited log lines for the KV-event path: one line per cause per interval.

A publisher that sends garbage at 20,000 messages a second must not write 20,000 log
lines: :func:`limited` logs the first line of a ``key`` (a cause, usually
``"<what>:<pod>"``) at once, drops the repeats for :data:`INTERVAL_S` seconds, and logs
the next one with how many were dropped (``"... (+N like this in the last 10 s)"``).
The counters in :mod:`router.events.stats` count every occurrence; the log is for
humans.

A minimal helper local to ``router.events`` (a general ``router/logs.py`` is being
written elsewhere; the two will be unified).
"""

from __future__ import annotations

import logging
import time
from typing import Any

#: seconds between two lines of one key
INTERVAL_S = 10.0
#: keys remembered at most (pod names come and go): beyond, the table starts over
MAX_KEYS = 4096

_last: dict[str, float] = {}
_dropped: dict[str, int] = {}


def limited(
    logger: logging.Logger,
    key: str,
    msg: str,
    *args: Any,
    level: int = logging.WARNING,
    interval_s: float = INTERVAL_S,
) -> bool:
    """``logger.log(level, msg, *args)`` unless ``key`` logged less than ``interval_s``
    ago; returns whether the line was written."""
    now = time.monotonic()
    last = _last.get(key)
    if last is not None and now - last < interval_s:
        _dropped[key] = _dropped.get(key, 0) + 1
        return False
    if len(_last) >= MAX_KEYS and key not in _last:
        _last.clear()
        _dropped.clear()
    _last[key] = now
    dropped = _dropped.pop(key, 0)
    if dropped:
        logger.log(level, msg + " (+%d like this in the last %g s)", *args, dropped, interval_s)
    else:
        logger.log(level, msg, *args)
    return True


def reset() -> None:
    """Forget every key (tests)."""
    _last.clear()
    _dropped.clear()
