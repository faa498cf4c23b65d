"""The circuit breaker's state machine (scoring/index/breaker.py), on a clock the test
moves; its use against a real, failing server is in test_redis_resilience.py."""

from __future__ import annotations

import pytest
from redis.backoff import ConstantBackoff, EqualJitterBackoff

from scoring.index.breaker import CircuitBreaker, SharedStateUnavailable
from tests.support.clock import ManualClock


def breaker(clock: ManualClock, n: int = 3, backoff_s: float = 1.0) -> CircuitBreaker:
    return CircuitBreaker(failures_to_open=n, backoff=ConstantBackoff(backoff_s), clock=clock)


def fail(b: CircuitBreaker, times: int, kind: str = "timeout") -> None:
    for _ in range(times):
        b.failure("lookup", kind, b.admit("lookup"))


def test_n_consecutive_failures_open_it_and_a_success_in_between_resets_the_count() -> None:
    clock = ManualClock(100.0)
    b = breaker(clock)
    fail(b, 2)
    b.success(b.admit("lookup"))
    fail(b, 2)
    assert b.state == "closed" and not b.is_open and b.degraded == 0
    fail(b, 1)
    assert b.state == "open" and b.is_open and b.degraded == 1
    assert b.opened == 1


def test_while_open_calls_are_refused_at_once_and_counted_as_open() -> None:
    clock = ManualClock(100.0)
    b = breaker(clock)
    fail(b, 3)
    with pytest.raises(SharedStateUnavailable) as err:
        b.admit("owner_get")
    assert (err.value.op, err.value.kind) == ("owner_get", "open")
    assert "next probe in 1.00s" in str(err.value)
    assert b.errors[("owner_get", "open")] == 1
    assert b.errors[("lookup", "timeout")] == 3
    assert b.errors_by_kind() == {"timeout": 3, "open": 1}


def test_after_the_backoff_one_probe_goes_through_and_its_success_closes_it() -> None:
    clock = ManualClock(100.0)
    b = breaker(clock)
    fail(b, 3)
    clock.now += 0.99
    with pytest.raises(SharedStateUnavailable):
        b.admit("lookup")
    clock.now += 0.02
    assert b.admit("lookup") is True  # the probe
    assert b.state == "half_open"
    with pytest.raises(SharedStateUnavailable):
        b.admit("load_snapshot")  # only one probe at a time
    b.success(probe=True)
    assert b.state == "closed"
    assert b.admit("lookup") is False


def test_a_failed_probe_reopens_it_with_the_next_longer_backoff() -> None:
    clock = ManualClock(100.0)
    delays: list[int] = []

    class Recording:
        def compute(self, failures: int) -> float:
            delays.append(failures)
            return float(failures)

    b = CircuitBreaker(failures_to_open=1, backoff=Recording(), clock=clock)
    fail(b, 1)
    clock.now += 1.0
    fail(b, 1)  # the probe fails
    assert b.state == "open" and b.retry_in() == pytest.approx(2.0)
    clock.now += 2.0
    b.success(b.admit("lookup"))
    fail(b, 1)  # a new outage starts from the first backoff again
    assert delays == [1, 2, 1]


def test_the_default_backoff_is_exponential_with_equal_jitter_and_capped() -> None:
    backoff = CircuitBreaker().backoff
    assert isinstance(backoff, EqualJitterBackoff)
    for n, (lo, hi) in {1: (0.25, 0.5), 2: (0.5, 1.0), 3: (1.0, 2.0), 10: (2.5, 5.0)}.items():
        draws = [backoff.compute(n) for _ in range(200)]
        assert all(lo <= d <= hi for d in draws), (n, min(draws), max(draws))
        assert max(draws) - min(draws) > (hi - lo) / 4  # jittered, not fixed


def test_error_replies_prove_the_server_is_up_and_never_open_it() -> None:
    clock = ManualClock(100.0)
    b = breaker(clock)
    fail(b, 2)
    fail(b, 10, kind="error")  # READONLY, OOM, a script error: answered
    fail(b, 2)
    assert b.state == "closed"
    assert b.errors_by_kind() == {"timeout": 4, "error": 10}


def test_an_error_reply_to_the_probe_closes_it() -> None:
    clock = ManualClock(100.0)
    b = breaker(clock)
    fail(b, 3)
    clock.now += 1.0
    b.failure("owner_put", "error", b.admit("owner_put"))
    assert b.state == "closed"


def test_an_abandoned_probe_frees_the_probe_slot() -> None:
    clock = ManualClock(100.0)
    b = breaker(clock)
    fail(b, 3)
    clock.now += 1.0
    assert b.admit("lookup") is True
    b.abandon(probe=True)  # cancelled before an answer
    assert b.state == "open"
    assert b.admit("lookup") is True  # the next call probes at once


def test_listeners_hear_every_error_and_state_change_until_removed() -> None:
    clock = ManualClock(100.0)
    b = breaker(clock, n=2)
    errors: list[tuple[str, str]] = []
    states: list[str] = []
    remove = b.listen(on_error=lambda op, kind: errors.append((op, kind)), on_state=states.append)
    fail(b, 2)
    with pytest.raises(SharedStateUnavailable):
        b.admit("load_write")
    clock.now += 1.0
    b.success(b.admit("lookup"))
    assert errors == [("lookup", "timeout"), ("lookup", "timeout"), ("load_write", "open")]
    assert states == ["open", "half_open", "closed"]
    remove()
    fail(b, 2)
    assert len(errors) == 3 and len(states) == 3


def test_a_listener_that_raises_does_not_break_the_breaker(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = ManualClock(100.0)
    b = breaker(clock, n=1)

    def broken(state: str) -> None:
        raise RuntimeError("listener bug")

    b.listen(on_state=broken)
    fail(b, 1)
    assert b.state == "open"
    assert "state listener failed" in caplog.text


def test_failures_to_open_must_be_a_positive_int() -> None:
    with pytest.raises(ValueError, match="failures_to_open must be an int >= 1, got 0"):
        CircuitBreaker(failures_to_open=0)
