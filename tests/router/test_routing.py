"""The ranking of candidates after a decision (router.decision.request.rank): the decision's pod
first, then by score (lower or higher is better), unscored pods last, ties in the
candidates' order."""

from __future__ import annotations

from router.decision.request import rank
from scoring.policies.base import Decision


def test_lower_is_better_ranks_by_ascending_score_after_the_chosen_pod() -> None:
    d = Decision(pod="c", scores={"a": 3.0, "b": 1.0, "c": 2.0, "d": 1.0}, lower_is_better=True)
    assert rank(d, ["a", "b", "c", "d"]) == ["c", "b", "d", "a"]


def test_higher_is_better_ranks_by_descending_score_ties_in_candidate_order() -> None:
    d = Decision(pod="a", scores={"a": 9.0, "b": 1.0, "c": 5.0, "d": 5.0})
    assert rank(d, ["a", "b", "c", "d"]) == ["a", "c", "d", "b"]
    assert rank(d, ["a", "d", "c", "b"]) == ["a", "d", "c", "b"]


def test_unscored_pods_come_last_in_candidate_order() -> None:
    d = Decision(pod="a", scores={"a": 1.0, "c": 2.0}, lower_is_better=True)
    assert rank(d, ["a", "x", "c", "y"]) == ["a", "c", "x", "y"]
    d = Decision(pod="a", scores={"a": 1.0, "c": 2.0})
    assert rank(d, ["y", "a", "x", "c"]) == ["a", "c", "y", "x"]
