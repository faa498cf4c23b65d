"""The decode load a model's pods report in their scraped histograms, for a router that
sees none of their first tokens (scoring/policies/scraped_steps.py)."""

from __future__ import annotations

import math
import random

import pytest

from scoring.policies.base import PodCounters
from scoring.policies.scraped_steps import ScrapedSteps


def drive(steps: ScrapedSteps, pod: str, intervals: list[tuple[int, float]]) -> None:
    """Scrapes of ``pod`` whose interval ``i`` ran ``running`` requests at ``step_s``
    seconds a step (100 decoded tokens an interval)."""
    total_s = count = 0.0
    running = intervals[0][0]
    steps.scraped(pod, PodCounters(running=running, itl_sum_s=0.0, itl_count=0.0))
    for running, step_s in intervals:
        total_s += 100 * step_s
        count += 100
        steps.scraped(pod, PodCounters(running=running, itl_sum_s=total_s, itl_count=count))


def test_the_step_time_each_running_request_adds_is_learned_from_the_histograms() -> None:
    rng = random.Random(3)
    steps = ScrapedSteps()
    # an engine whose step takes 8 ms + 0.5 ms per running request
    for pod in ("a", "b"):
        drive(
            steps, pod, [(n, 0.008 + 0.0005 * n) for n in (rng.randint(1, 60) for _ in range(400))]
        )
    assert steps.per_running_s == pytest.approx(0.0005, rel=0.05)


def test_running_counts_that_do_not_vary_teach_no_slope() -> None:
    steps = ScrapedSteps()
    drive(steps, "a", [(8, 0.02)] * 300)
    assert steps.per_running_s == 0.0  # the prior, not 0.02 / 8


def test_a_decode_time_comes_from_the_requests_finished_between_two_scrapes() -> None:
    steps = ScrapedSteps()
    assert steps.scraped("a", PodCounters(decode_sum_s=10.0, decode_count=4.0)) is None
    assert steps.scraped("a", PodCounters(decode_sum_s=16.0, decode_count=6.0)) == 3.0
    assert steps.scraped("a", PodCounters(decode_sum_s=16.0, decode_count=6.0)) is None
    # an engine restart: its counters start again, and the interval tells nothing
    assert steps.scraped("a", PodCounters(decode_sum_s=1.0, decode_count=1.0)) is None
    assert steps.scraped("a", PodCounters(decode_sum_s=3.0, decode_count=2.0)) == 2.0


def test_a_broken_histogram_is_dropped_and_counted() -> None:
    steps = ScrapedSteps()
    steps.scraped("a", PodCounters(running=1, itl_sum_s=0.0, itl_count=0.0))
    steps.scraped("a", PodCounters(running=2, itl_sum_s=math.inf, itl_count=10.0))
    steps.scraped("a", PodCounters(decode_sum_s=0.0, decode_count=0.0))
    assert steps.scraped("a", PodCounters(decode_sum_s=math.nan, decode_count=1.0)) is None
    assert steps.rejected == 2
    assert steps.per_running_s == 0.0
