"""The first tokens a router never sees (JSON answers forwarded as they came), released
by the pod's own count of first tokens (scoring/unseen_first_tokens.py)."""

from __future__ import annotations

import math

from scoring.unseen_first_tokens import UnseenFirstTokens


def tracker(*pending: str, pod: str = "p", count: float = 10.0) -> UnseenFirstTokens[str]:
    """A tracker whose first scrape of ``pod`` read ``count``, with ``pending`` expected."""
    u: UnseenFirstTokens[str] = UnseenFirstTokens()
    for t in pending:
        u.expect(pod, t)
    assert u.scraped(pod, count, None) == []  # the first scrape sets the baseline
    return u


def test_first_tokens_the_router_did_not_see_release_the_oldest_pending_requests() -> None:
    u = tracker("a", "b", "c")
    assert u.scraped("p", 12.0, None) == ["a", "b"]
    assert u.pending("p") == 1
    assert u.scraped("p", 12.0, None) == []  # nothing new
    assert u.scraped("p", 20.0, None) == ["c"]  # never more than are pending


def test_first_tokens_the_router_saw_are_not_counted_as_unseen() -> None:
    u = tracker("a", "b")
    u.seen("p")
    u.seen("p")  # two streamed answers' first tokens
    assert u.scraped("p", 12.0, None) == []
    assert u.scraped("p", 13.0, None) == ["a"]


def test_a_request_that_ends_first_is_dropped_and_says_its_load_was_still_held() -> None:
    u = tracker("a", "b")
    assert u.ended("p", "a") is True  # still pending: the caller releases it at its end
    assert u.scraped("p", 11.0, None) == ["b"]
    assert u.ended("p", "b") is False  # released by the scrape already
    assert u.ended("p") is False  # a streamed request's end


def test_an_engine_restart_starts_the_count_again() -> None:
    u = tracker("a", "b", count=100.0)
    assert u.scraped("p", 3.0, None) == []  # the count went back: a new baseline
    assert u.scraped("p", 4.0, None) == ["a"]


def test_a_pod_that_exports_no_count_or_a_broken_one_releases_nothing() -> None:
    u: UnseenFirstTokens[str] = UnseenFirstTokens()
    u.expect("p", "a")
    for count in (None, math.nan, -1.0):
        assert u.scraped("p", count, None) == []
    assert u.scraped("q", 5.0, None) == []  # a pod with nothing expected
    assert u.pending("p") == 1


def test_other_routers_first_tokens_are_discounted_by_this_router_s_share() -> None:
    u: UnseenFirstTokens[str] = UnseenFirstTokens()
    for t in "abcd":
        u.expect("p", t)
    assert u.scraped("p", 0.0, 0.0) == []
    # the pod finished 4 requests, one of them ours: a quarter of its 8 first tokens
    u.ended("p")
    assert u.scraped("p", 8.0, 4.0) == ["a", "b"]
    # alone in front of it (every finished request ours): all of them
    alone = tracker("a", "b", count=0.0)
    alone.ended("p")
    assert alone.scraped("p", 2.0, None) == ["a", "b"]


def test_a_pod_that_left_is_forgotten() -> None:
    u = tracker("a")
    u.forget("p")
    assert u.pending("p") == 0
    assert u.scraped("p", 50.0, None) == []  # a new baseline, nothing pending
