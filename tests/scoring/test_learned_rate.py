"""The fleet's prefill rate learned from first tokens (scoring/policies/learned_rate.py),
and ``cost`` pricing its predictions with it."""

from __future__ import annotations

import math

import pytest

from scoring.policies import PodView, RouteRequest, build_policy
from scoring.policies.cost import CostPolicy
from scoring.policies.learned_rate import PrefillRate
from tests.support.clock import ManualClock

BS = 16


def serve_fcfs(
    rate: PrefillRate,
    pod: str,
    arrivals: list[tuple[float, int]],
    tps: float,
    per_request_s: float = 0.0,
) -> None:
    """``pod`` serves ``(routed at, tokens)`` in order, one at a time: ``per_request_s``
    plus the tokens at ``tps`` tokens/s each."""
    free_at = 0.0
    for at, tokens in arrivals:
        start = max(at, free_at)
        free_at = start + per_request_s + tokens / tps
        assert rate.first_token(pod, at, free_at, tokens) is None


def test_before_any_first_token_the_rate_is_the_prior() -> None:
    assert PrefillRate(5000.0).rate == 5000.0
    with pytest.raises(ValueError, match="prior_rate"):
        PrefillRate(0.0)


def test_a_pod_serving_fcfs_is_measured_at_its_rate_queued_or_idle() -> None:
    """Queued requests' service starts at the previous first token, not at their routing
    (the wait is queueing); an idle pod's starts at the routing (the gap is not work)."""
    rate = PrefillRate(5000.0)
    burst = [(0.0, 500 + 50 * i) for i in range(20)]  # all queued at once
    idle = [(100.0 + 10.0 * i, 200 + 37 * (i % 40)) for i in range(300)]  # one at a time
    serve_fcfs(rate, "p", burst + idle, tps=2000.0, per_request_s=0.03)
    assert rate.rate == pytest.approx(2000.0, rel=0.02)


def test_the_per_request_time_is_not_charged_to_the_tokens() -> None:
    """Mostly cache hits (a few uncached tokens each, a 30 ms step apiece) and a few
    misses: tokens over seconds would read the 20,000 tokens/s pod at a few thousand."""
    rate = PrefillRate(5000.0)
    sizes = [16 * (i % 4) if i % 10 else 4000 + 16 * (i % 7) for i in range(600)]
    serve_fcfs(rate, "p", [(1.0 * i, n) for i, n in enumerate(sizes)], 20_000.0, 0.03)
    assert rate.rate == pytest.approx(20_000.0, rel=0.02)
    tokens_over_seconds = sum(sizes) / sum(0.03 + n / 20_000.0 for n in sizes)
    assert tokens_over_seconds < 10_000.0


def test_pods_prefilling_side_by_side_do_not_share_their_service_time() -> None:
    rate = PrefillRate(5000.0)
    for k in range(100):
        for j, pod in enumerate(("a", "b", "c")):
            serve_fcfs(rate, pod, [(float(k), 300 + 100 * ((k + j) % 7))], tps=1000.0)
    assert rate.rate == pytest.approx(1000.0, rel=0.02)


def test_observations_that_cannot_tell_a_slope_leave_the_prior() -> None:
    rate = PrefillRate(5000.0)
    serve_fcfs(rate, "p", [(10.0 * i, 1000) for i in range(50)], tps=1000.0)
    assert rate.rate == pytest.approx(5000.0)  # one size only: any rate fits
    serve_fcfs(rate, "q", [(10.0 * i, 1000 + 200 * (i % 5)) for i in range(2)], tps=1000.0)
    assert 1000.0 < rate.rate < 5000.0  # a first slope, against the prior's weight
    serve_fcfs(rate, "q", [(100.0 + 10.0 * i, 500 + 200 * (i % 5)) for i in range(300)], 1000.0)
    assert rate.rate == pytest.approx(1000.0, rel=0.02)


@pytest.mark.parametrize("hit_tokens", [5, 0])
def test_a_long_run_of_one_size_keeps_the_rate_it_learned(hit_tokens: int) -> None:
    """A load test's one repeated prompt: hits and the odd miss teach the rate, then
    200,000 identical hits (5 uncached tokens each, or 0: the whole prompt cached) with
    jittering service times follow.  They cannot tell a slope.  Once what the sums keep
    of the earlier spread is below their rounding, or has sunk into the floats'
    underflow (about 180,000 observations on), a fit of what is left read the 40,000
    tokens/s pods at 2 tokens/s (`bench_wrk_overhead.py`, session 34)."""
    rate = PrefillRate(5000.0)
    sizes = [21 if i % 8 == 0 else hit_tokens for i in range(2000)]
    serve_fcfs(rate, "p", [(0.01 * i, n) for i, n in enumerate(sizes)], 40_000.0, 1e-4)
    learned = rate.rate
    assert learned == pytest.approx(40_000.0, rel=0.02)
    low = high = learned
    for i in range(200_000):
        at = 100.0 + 0.01 * i
        jitter = 1e-4 * (1 + (i * 7919) % 13 / 13)  # the service time varies, the size not
        assert rate.first_token("p", at, at + jitter, hit_tokens) is None
        low, high = min(low, rate.rate), max(high, rate.rate)
    # while the earlier spread still weighs, the fit moves with the jitter (to about
    # 0.84x here); then it keeps its rate
    assert learned / 1.5 < low <= high < learned * 1.5


def test_the_rate_follows_a_pod_that_slows_down() -> None:
    rate = PrefillRate(5000.0, memory=64)
    serve_fcfs(rate, "p", [(10.0 * i, 500 + 97 * (i % 11)) for i in range(200)], tps=4000.0)
    later = [(5000.0 + 10.0 * i, 500 + 97 * (i % 11)) for i in range(400)]
    serve_fcfs(rate, "q", later, tps=1000.0)
    assert rate.rate == pytest.approx(1000.0, rel=0.05)


def test_bad_observations_are_dropped_counted_and_never_make_the_rate_bad() -> None:
    rate = PrefillRate(5000.0)
    serve_fcfs(rate, "p", [(0.0, 1000), (5.0, 2000)], tps=1000.0)
    before = rate.rate
    assert rate.first_token("p", 5.0, 6.0, math.nan) == "tokens"
    assert rate.first_token("p", 5.0, 6.0, -3) == "tokens"
    assert rate.first_token("p", 5.0, math.inf, 100) == "clock"
    assert rate.first_token("p", math.nan, 6.0, 100) == "clock"
    assert rate.first_token("p", 7.0, 6.0, 100) == "first token before routing"
    assert rate.rate == before and math.isfinite(rate.rate) and rate.rate > 0
    assert rate.rejected == {"tokens": 2, "clock": 2, "first token before routing": 1}


def test_a_fit_that_would_make_the_rate_bad_keeps_the_last_one() -> None:
    """Bigger requests answered sooner (a negative slope), every request fully cached,
    a prior forgotten entirely: the rate stays finite and positive."""
    rate = PrefillRate(5000.0, memory=2)
    for i in range(200):
        rate.first_token("p", 10.0 * i, 10.0 * i + (1.0 if i % 2 else 0.1), 100 * (i % 2 == 0))
        rate.first_token("q", 10.0 * i, 10.0 * i + 0.01, 0)
        assert math.isfinite(rate.rate) and rate.rate > 0


def req(rid: str, blocks: int) -> RouteRequest:
    keys = [hash((rid, i)) for i in range(blocks)]
    return RouteRequest(
        request_id=rid, model="m", prompt_tokens=blocks * BS, block_keys=keys, block_size=BS
    )


def test_cost_prices_a_miss_at_the_rate_its_first_tokens_show() -> None:
    """The operator said 5000 tokens/s; the pods' first tokens say 1000 (and a 50 ms
    step per request, which is not the tokens'): a 1,600-token miss on an idle pod is
    then predicted at 1.6 s, and ``learned()`` says so."""
    policy = build_policy("cost", {"prefill_rate_tokens_per_s": 5000.0, "kv_admission": False})
    assert isinstance(policy, CostPolicy)
    clock = ManualClock()
    policy.clock = clock
    views = [PodView(pod="p0"), PodView(pod="p1")]
    assert policy.learned() == {}  # no request of the model yet
    for i in range(300):  # one at a time, misses of 800-2,384 tokens at 1000 tokens/s
        r = req(f"r{i}", 50 + i % 100)
        pod = policy.pick(r, views).pod
        policy.on_routed(r, pod)
        clock.now += 0.05 + r.prompt_tokens / 1000.0  # and a 50 ms step apiece
        policy.on_first_token(r, pod, 1.6)
        policy.on_complete(r, pod)
        clock.now += 1.0
    assert policy.learned()["prefill_rate_tokens_per_s", "m"] == pytest.approx(1000.0, rel=0.02)
    decision = policy.pick(req("next", 100), views)
    assert decision.scores["p0"] == pytest.approx(1.6, rel=0.02)
    assert policy.rejected_observations() == {}


def test_cost_with_learning_off_keeps_the_setting() -> None:
    policy = build_policy("cost", {"learn_prefill_rate": False, "kv_admission": False})
    clock = ManualClock()
    policy.clock = clock
    r = req("a", 100)
    policy.on_routed(r, "p0")
    clock.now = 10.0
    policy.on_first_token(r, "p0", 10.0)
    policy.on_complete(r, "p0")
    assert policy.pick(req("b", 100), [PodView(pod="p0")]).scores["p0"] == pytest.approx(0.32)
    assert policy.learned() == {("prefill_rate_tokens_per_s", "m"): 5000.0}


def test_each_model_is_priced_at_its_own_pods_rate() -> None:
    """One router in front of a small and a large model: each learns its own rate."""
    policy = build_policy("cost", {"kv_admission": False})
    clock = ManualClock()
    policy.clock = clock
    views = [PodView(pod="small-0"), PodView(pod="large-0")]
    for i in range(300):
        for model, pod, tps in (("small", "small-0", 8000.0), ("large", "large-0", 1000.0)):
            r = RouteRequest(
                request_id=f"{model}{i}",
                model=model,
                prompt_tokens=(50 + i % 100) * BS,
                block_keys=[hash((model, i, k)) for k in range(50 + i % 100)],
                block_size=BS,
            )
            policy.pick(r, [v for v in views if v.pod == pod])
            policy.on_routed(r, pod)
            clock.now += 0.02 + r.prompt_tokens / tps
            policy.on_first_token(r, pod, 0.0)
            policy.on_complete(r, pod)
            clock.now += 1.0
    learned = policy.learned()
    assert learned["prefill_rate_tokens_per_s", "small"] == pytest.approx(8000.0, rel=0.02)
    assert learned["prefill_rate_tokens_per_s", "large"] == pytest.approx(1000.0, rel=0.02)


def test_without_a_tie_band_or_kv_wait_the_rate_only_scales_the_predictions() -> None:
    """Every term of the score but the tie band and the wait for KV room is tokens over
    the rate: with both off, two very different rates make the same choices, each
    prediction scaled by their ratio.  (So where a learned rate changes decisions, it
    is through those two.)"""
    import random

    rng = random.Random(7)
    fixed = {"learn_prefill_rate": False, "tie_epsilon_s": 0.0, "kv_admission": False}
    slow = build_policy("cost", {**fixed, "prefill_rate_tokens_per_s": 2_000.0})
    fast = build_policy("cost", {**fixed, "prefill_rate_tokens_per_s": 50_000.0})
    for policy in (slow, fast):
        policy.clock = lambda: 0.0
    for i in range(200):
        keys = [rng.randrange(4) for _ in range(rng.randint(1, 12))]
        views = [
            PodView(
                pod=f"p{j}",
                hits={"GPU": rng.randint(0, len(keys))},
                outstanding_prefill_tokens=rng.randint(0, 4000),
                running=rng.randint(0, 8),
            )
            for j in range(4)
        ]
        request = RouteRequest(f"r{i}", "m", len(keys) * BS + 5, keys, BS)
        a, b = slow.pick(request, views), fast.pick(request, views)
        assert a.pod == b.pod
        for pod, score in a.scores.items():
            assert score == pytest.approx(b.scores[pod] * 25.0)
        for policy, decision in ((slow, a), (fast, b)):
            policy.on_routed(request, decision.pod)
            if i % 3 == 0:
                policy.on_complete(request, decision.pod)
