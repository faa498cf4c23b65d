"""router.logs.RateLimitedLog: one line per cause per interval, the count of the lines
left out carried by the next line of that cause."""

from __future__ import annotations

import logging

import pytest

from router.logs import RateLimitedLog
from tests.support.clock import ManualClock


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(1000.0)


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "test.limited"]


def test_a_flood_of_one_cause_is_one_line_then_one_line_with_the_count(
    caplog: pytest.LogCaptureFixture, clock: ManualClock
) -> None:
    caplog.set_level(logging.WARNING, logger="test.limited")
    limited = RateLimitedLog(logging.getLogger("test.limited"), 10.0, clock=clock)
    sent = [
        limited.warning("stream_broken", "stream from %s broke", f"p{i}") for i in range(10_000)
    ]
    assert sent.count(True) == 1
    assert messages(caplog) == ["stream from p0 broke"]
    assert limited.suppressed("stream_broken") == 9_999
    clock.now += 10.0
    assert limited.warning("stream_broken", "stream from %s broke", "p-late")
    assert messages(caplog)[1] == (
        "stream from p-late broke [9999 similar lines suppressed in the last 10.0 s]"
    )
    assert limited.suppressed("stream_broken") == 0


def test_causes_are_limited_separately(
    caplog: pytest.LogCaptureFixture, clock: ManualClock
) -> None:
    caplog.set_level(logging.WARNING, logger="test.limited")
    limited = RateLimitedLog(logging.getLogger("test.limited"), 10.0, clock=clock)
    for _ in range(5):
        limited.warning(("stream_broken", "a"), "a broke")
        limited.warning(("stream_broken", "b"), "b broke")
    assert messages(caplog) == ["a broke", "b broke"]


def test_a_cause_logs_again_after_the_interval_without_a_count_when_none_was_left_out(
    caplog: pytest.LogCaptureFixture, clock: ManualClock
) -> None:
    caplog.set_level(logging.WARNING, logger="test.limited")
    limited = RateLimitedLog(logging.getLogger("test.limited"), 10.0, clock=clock)
    limited.warning("x", "one")
    clock.now += 10.5
    limited.warning("x", "two")
    assert messages(caplog) == ["one", "two"]


def test_flush_reports_pending_counts(caplog: pytest.LogCaptureFixture, clock: ManualClock) -> None:
    caplog.set_level(logging.WARNING, logger="test.limited")
    limited = RateLimitedLog(logging.getLogger("test.limited"), 10.0, clock=clock)
    for _ in range(3):
        limited.warning("owner_put", "recording failed")
    clock.now += 2.0
    limited.flush()
    assert messages(caplog) == [
        "recording failed",
        "owner_put: 2 similar lines suppressed in the last 2.0 s",
    ]


def test_exception_logs_the_traceback_once_per_interval(
    caplog: pytest.LogCaptureFixture, clock: ManualClock
) -> None:
    caplog.set_level(logging.ERROR, logger="test.limited")
    limited = RateLimitedLog(logging.getLogger("test.limited"), 10.0, clock=clock)
    for _ in range(3):
        try:
            raise RecursionError("deep")
        except RecursionError:
            limited.exception("RecursionError", "request failed")
    records = [r for r in caplog.records if r.name == "test.limited"]
    assert len(records) == 1
    assert records[0].exc_info is not None and records[0].exc_info[0] is RecursionError


def test_the_line_names_the_caller_not_the_helper(
    caplog: pytest.LogCaptureFixture, clock: ManualClock
) -> None:
    caplog.set_level(logging.WARNING, logger="test.limited")
    limited = RateLimitedLog(logging.getLogger("test.limited"), clock=clock)
    limited.warning("c", "here")
    assert caplog.records[-1].funcName == "test_the_line_names_the_caller_not_the_helper"


def test_the_cause_table_stays_bounded(clock: ManualClock) -> None:
    limited = RateLimitedLog(logging.getLogger("test.limited"), max_causes=100, clock=clock)
    for i in range(10_000):
        limited.warning(("pod", i), "x")
    assert len(limited._causes) <= 100


def test_lines_below_the_logger_level_are_neither_logged_nor_counted(clock: ManualClock) -> None:
    logger = logging.getLogger("test.limited.quiet")
    logger.setLevel(logging.ERROR)
    limited = RateLimitedLog(logger, clock=clock)
    assert not limited.warning("x", "hidden")
    assert limited.suppressed("x") == 0
