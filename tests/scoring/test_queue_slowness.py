"""``cost``'s queue at each pod's own pace (``queue_slowness``, opt-in): a pod whose first
tokens come slower than the model's fit predicts has its queued tokens priced higher, a
faster one lower; a pod never seen, an idle queue and bad input change nothing."""

from __future__ import annotations

import math

import pytest

from scoring.policies import PodView, Policy, RouteRequest, build_policy
from scoring.policies.cost import CostPolicy
from scoring.policies.learned_rate import PRIOR_WEIGHT, PrefillRate

RATE = 1000.0  # tokens/s: the setting, not learned, so predictions are tokens / RATE


def req(rid: str, tokens: int = 1000, keys: list[int] | None = None) -> RouteRequest:
    return RouteRequest(rid, "m", tokens, keys or [], 16)


def policy_on(now: list[float], **params: object) -> CostPolicy:
    p = build_policy(
        "cost",
        {
            "queue_slowness": True,
            "learn_prefill_rate": False,
            "prefill_rate_tokens_per_s": RATE,
            "tie_break_by_room": False,
            **params,
        },
    )
    p.clock = lambda: now[0]
    assert isinstance(p, CostPolicy)
    return p


def serve(p: Policy, now: list[float], pod: str, n: int, seconds_each: float) -> None:
    """``n`` requests of 1,000 uncached tokens (1 s predicted), one after another on
    ``pod``, each answered ``seconds_each`` after it was routed."""
    for i in range(n):
        r = req(f"{pod}-{i}-{now[0]}")
        p.on_routed(r, pod)
        now[0] += seconds_each
        p.on_first_token(r, pod, seconds_each)
        p.on_complete(r, pod)


def test_a_pod_twice_as_slow_as_predicted_is_measured_near_twice() -> None:
    now = [0.0]
    p = policy_on(now)
    serve(p, now, "slow", 200, 2.0)
    serve(p, now, "fast", 200, 0.5)
    assert p.slowness("slow") == pytest.approx(2.0, rel=0.03)
    assert p.slowness("fast") == pytest.approx(0.5, rel=0.03)
    assert p.slowness("never seen") == 1.0


def test_one_observation_weighs_as_one_against_the_prior() -> None:
    now = [0.0]
    p = policy_on(now)
    serve(p, now, "a", 1, 3.0)
    # (3 s + PRIOR_WEIGHT x 1 s) / (1 s + PRIOR_WEIGHT x 1 s)
    assert p.slowness("a") == pytest.approx((3.0 + PRIOR_WEIGHT) / (1.0 + PRIOR_WEIGHT))


def test_a_queue_on_the_slower_pod_costs_more_than_the_same_queue_on_the_faster() -> None:
    now = [0.0]
    p = policy_on(now)
    serve(p, now, "slow", 100, 2.0)
    serve(p, now, "fast", 100, 0.5)
    queued = {"outstanding_prefill_tokens": 4000, "running": 0, "waiting": 2}
    slow = PodView(pod="slow", **queued)  # type: ignore[arg-type]
    fast = PodView(pod="fast", **queued)  # type: ignore[arg-type]
    d = p.pick(req("x"), [slow, fast])
    assert d.pod == "fast"
    # 4,000 queued tokens: 4 s predicted, ~8 s at the slow pod's pace, ~2 s at the fast
    # one's; the request's own (backlog-weighted) miss is the same on both
    gap = 4.0 * (p.slowness("slow") - p.slowness("fast"))
    assert gap == pytest.approx(6.0, rel=0.05)
    assert d.scores["slow"] - d.scores["fast"] == pytest.approx(gap)
    off = build_policy(
        "cost",
        {
            "learn_prefill_rate": False,
            "prefill_rate_tokens_per_s": RATE,
            "tie_break_by_room": False,
        },
    )
    even = off.pick(req("x"), [slow, fast]).scores
    assert even["slow"] == even["fast"]  # off: the same queue is the same wait


def test_an_idle_fleet_decides_as_without_it() -> None:
    """No queue, nothing to pace: the ties that spread new prefixes stay ties."""
    now = [0.0]
    p = policy_on(now, tie_break_by_room=True)
    serve(p, now, "slow", 50, 3.0)
    idle = [PodView(pod=name, outstanding_prefill_tokens=0) for name in ("slow", "fast")]
    d = p.pick(req("y"), idle)
    assert d.scores["slow"] == d.scores["fast"] == pytest.approx(1.0)


def test_nonsense_first_tokens_leave_the_pace_alone() -> None:
    now = [0.0]
    p = policy_on(now)
    serve(p, now, "a", 20, 2.0)
    before = p.slowness("a")
    for bad in (math.nan, -5.0, math.inf):
        r = RouteRequest(f"bad{bad}", "m", 1000, [], 16)
        p.on_routed(r, "a")
        p._live[(r.request_id, id(r))][2] = bad  # a prediction gone wrong
        now[0] += 1.0
        p.on_first_token(r, "a", 1.0)
        p.on_complete(r, "a")
    assert p.slowness("a") == before
    assert math.isfinite(p.slowness("a"))
    # counted (the rate is set here, so the pace counts them itself)
    assert p.rejected_observations() == {"first token": 3}


def test_a_pod_that_leaves_is_forgotten() -> None:
    now = [0.0]
    p = policy_on(now)
    serve(p, now, "gone", 20, 3.0)
    assert p.slowness("gone") > 1.5
    p.on_pod_removed("gone")
    assert p.slowness("gone") == 1.0


def test_each_seen_pod_s_pace_is_reported_as_the_scores_use_it() -> None:
    """``learned_per_pod`` (``kvroute_policy_pod_learned``): the pace of every pod whose
    first tokens were seen, none for a pod never seen or gone, nothing with the option
    off."""
    now = [0.0]
    p = policy_on(now)
    assert p.learned_per_pod() == {}
    serve(p, now, "slow", 50, 2.0)
    serve(p, now, "fast", 50, 0.5)
    serve(p, now, "gone", 5, 1.0)
    p.on_pod_removed("gone")
    learned = p.learned_per_pod()
    assert set(learned) == {("queue_slowness", "slow"), ("queue_slowness", "fast")}
    assert learned["queue_slowness", "slow"] == p.slowness("slow") > 1.5
    assert learned["queue_slowness", "fast"] == p.slowness("fast") < 0.75
    off = policy_on(now, queue_slowness=False)
    serve(off, now, "slow", 5, 2.0)
    assert off.learned_per_pod() == {}


def test_the_fit_s_per_request_time_is_its_intercept() -> None:
    rate = PrefillRate(1000.0)
    assert rate.per_request_s() == 0.0  # nothing seen
    for i in range(400):
        tokens = 500.0 + 10.0 * (i % 50)
        rate.first_token("p", 10.0 * i, 10.0 * i + 0.05 + tokens / 2000.0, tokens)
    assert rate.rate == pytest.approx(2000.0, rel=0.02)
    assert rate.per_request_s() == pytest.approx(0.05, abs=0.01)
