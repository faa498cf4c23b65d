"""The first tokens a router never sees (JSON answers forwarded as they came), released
by the pod's own count of first tokens (scoring/unseen_first_tokens.py)."""

from __future__ import annotations

import math

from scoring.unseen_first_tokens import UnseenFirstTokens


def tracker(*pending: str, pod: str = "p", count: float = 10.0) -> UnseenFirstTokens[str]:
    """A tracker whose first scrape of ``pod`` read ``count``, with ``pending`` expected."""
    u: UnseenFirstTokens[str] = UnseenFirstTokens()
    assert u.scraped(pod, count, None) == []  # the first scrape sets the baseline
    for t in pending:
        u.expect(pod, t)
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
    u.expect("p", "c")
    assert u.scraped("p", 4.0, None) == ["c"]


def test_requests_sent_before_the_count_s_baseline_wait_for_their_end() -> None:
    u: UnseenFirstTokens[str] = UnseenFirstTokens()
    u.expect("p", "early")  # its first token may be in the first count
    assert u.scraped("p", 1.0, None) == []
    u.expect("p", "late")
    assert u.scraped("p", 2.0, None) == ["late"]  # not the early one, whose token it isn't
    assert u.pending("p") == 0
    assert u.ended("p", "early") is True  # its load is released at its end


def test_a_pod_that_exports_no_count_or_a_broken_one_releases_nothing() -> None:
    u = tracker("a")
    for count in (None, math.nan, -1.0):
        assert u.scraped("p", count, None) == []
    assert u.scraped("q", 5.0, None) == []  # a pod with nothing expected
    assert u.pending("p") == 1


def test_other_routers_first_tokens_are_discounted_by_this_router_s_share() -> None:
    u: UnseenFirstTokens[str] = UnseenFirstTokens()
    assert u.scraped("p", 0.0, 0.0) == []
    for _ in range(2):  # two streamed requests of ours, seen and ended
        u.started("p")
        u.seen("p")
        u.ended("p")
    for t in "abcd":  # four JSON ones, open
        u.started("p")
        u.expect("p", t)
    # the pod finished 12 requests, at most 6 of them ours: half of its 8 first tokens,
    # less the 2 seen here
    assert u.scraped("p", 8.0, 12.0) == ["a", "b"]


def test_alone_in_front_of_a_pod_every_first_token_it_counts_is_this_router_s() -> None:
    u = tracker("a", "b", count=0.0)
    u.scraped("p", 0.0, 0.0)
    for _ in "ab":
        u.started("p")
    # both finished on the pod, neither has ended here yet: still all ours
    assert u.scraped("p", 2.0, 2.0) == ["a", "b"]


def test_a_pod_that_left_is_forgotten() -> None:
    u = tracker("a")
    u.forget("p")
    assert u.pending("p") == 0
    assert u.scraped("p", 50.0, None) == []  # a new baseline, nothing pending
