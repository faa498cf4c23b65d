"""A clock a test moves by hand, for the code that takes a ``clock`` callable."""

from __future__ import annotations


class ManualClock:
    """Returns ``now``, which the test sets or advances; with ``step``, each read first
    moves it that much later (events read in order get distinct, ordered times)."""

    def __init__(self, now: float = 0.0, step: float = 0.0) -> None:
        self.now = now
        self.step = step

    def __call__(self) -> float:
        self.now += self.step
        return self.now
