"""The selection steps the policies share (scoring.policies.select)."""

from __future__ import annotations

import random

import pytest

from scoring.policies.base import NoCandidatesError
from scoring.policies.select import draw, highest, lowest, require_candidates


def test_an_empty_candidate_list_raises_naming_the_policy() -> None:
    with pytest.raises(NoCandidatesError, match=r"^least_load: no candidate pods$"):
        require_candidates("least_load", [])
    require_candidates("least_load", ["a"])  # one candidate is enough


def test_a_lone_candidate_is_chosen_without_drawing_a_random_number() -> None:
    rng = random.Random(7)
    state = rng.getstate()
    assert draw(["only"], rng) == "only"
    assert rng.getstate() == state


def test_ties_are_drawn_uniformly_so_the_first_candidate_is_not_favoured() -> None:
    rng = random.Random(0)
    counts = dict.fromkeys("abc", 0)
    for _ in range(3000):
        chosen, tied = lowest(["a", "b", "c", "d"], [1, 1, 1, 2], rng)
        assert tied == 3
        counts[chosen] += 1
    assert all(800 < n < 1200 for n in counts.values()), counts


def test_lowest_and_highest_pick_the_extreme_key_and_count_the_ties() -> None:
    rng = random.Random(0)
    assert lowest(["a", "b", "c"], [(3, 1), (2, 9), (2, 10)], rng) == ("b", 1)
    assert highest(["a", "b", "c"], [0.5, 2.0, 1.0], rng) == ("b", 1)
    chosen, tied = highest(["a", "b", "c"], [2.0, 2.0, 1.0], rng)
    assert chosen in ("a", "b") and tied == 2
