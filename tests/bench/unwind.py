"""One switch the benches that start processes share."""

from __future__ import annotations

import signal


def unwind_on_sigterm() -> None:
    """Make SIGTERM (a timeout, a CI runner, ``kill PID``) unwind like Ctrl-C, so that every
    ``finally`` stops the processes the bench started (the default action would leave
    them running)."""

    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)
