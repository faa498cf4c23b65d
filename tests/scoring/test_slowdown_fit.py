"""The decode slowdown ``cost`` learns when it is not given one
(scoring/policies/slowdown_fit.py): from clean first tokens only."""

from __future__ import annotations

import math

import pytest

from scoring.policies import PodView, RouteRequest, build_policy
from scoring.policies.learned_rate import PrefillRate
from scoring.policies.slowdown_fit import REFIT_EVERY, SlowdownFit, clean_running
from tests.support.clock import ManualClock

BS = 16


def fit() -> SlowdownFit:
    return SlowdownFit(5000.0, memory=256.0, prior_weight=4.0)


def feed(
    f: SlowdownFit, slowdown: float, running_of: object, n: int = 1000, step_s: float = 0.0
) -> None:
    """Prefills of 800-2,384 tokens at 1000 tokens/s, each slowed by ``slowdown`` per
    request running beside it, plus 50 ms and ``step_s`` per running request apiece."""
    for i in range(n):
        tokens = (50 + i % 100) * BS
        running = running_of(i)  # type: ignore[operator]
        service = 0.05 + step_s * running + tokens / 1000.0 * (1.0 + slowdown * running)
        f.add(tokens, running, service)


def test_a_slowdown_is_recovered_from_running_counts_that_vary() -> None:
    """Within 1% once the prior is forgotten (within 8% after 400 observations: the
    prior's pull on three correlated slopes)."""
    f = fit()
    assert f.slowdown == 0.0  # the prior: none
    feed(f, 0.1, lambda i: (i * 7) % 21)
    assert f.slowdown == pytest.approx(0.1, rel=0.01)


def test_the_longer_step_every_running_request_makes_is_not_read_as_a_slowdown() -> None:
    """10 ms per running request on every first token, whatever its length: a first
    token needs at least one engine step, and each running request's decode lengthens
    every step.  That is not a slowdown of the prompt's tokens, and beside one the
    slowdown is still recovered."""
    floor_only = fit()
    feed(floor_only, 0.0, lambda i: (i * 7) % 21, step_s=0.01)
    assert floor_only.slowdown == 0.0
    both = fit()
    feed(both, 0.1, lambda i: (i * 7) % 21, step_s=0.01)
    assert both.slowdown == pytest.approx(0.1, rel=0.01)


def test_the_seconds_each_running_request_adds_to_a_step_are_learned_too() -> None:
    """The same 10 ms per running request: kept as the step time a running request
    adds (the prior: 0), beside a slowdown or without one; a floor that falls as more
    requests run is not a step time (0)."""
    f = fit()
    assert f.per_running_s == 0.0
    feed(f, 0.0, lambda i: (i * 7) % 21, step_s=0.01)
    assert f.per_running_s == pytest.approx(0.01, rel=0.02)  # (the prior's last pull)
    both = fit()
    feed(both, 0.1, lambda i: (i * 7) % 21, step_s=0.01)
    # (within 10%: the prior's pull on three correlated slopes, as for the slowdown)
    assert both.per_running_s == pytest.approx(0.01, rel=0.1)
    falling = fit()
    feed(falling, 0.0, lambda i: (i * 7) % 21, step_s=-0.001)
    assert falling.per_running_s == 0.0


def test_a_speed_up_gives_no_slowdown_and_constant_counts_tell_nothing_new() -> None:
    faster = fit()
    feed(faster, -0.02, lambda i: (i * 7) % 21)
    assert faster.slowdown == 0.0
    constant = fit()
    feed(constant, 0.1, lambda i: 10)
    assert 0.0 <= constant.slowdown < 0.1 and math.isfinite(constant.slowdown)


def test_a_long_run_at_one_running_count_keeps_what_was_learned() -> None:
    """An idle spell: 300,000 clean first tokens with nothing running beside them (their
    sizes vary).  They tell neither slope.  Without a check, the solve read the spread
    left in the forgetting sums from the earlier running counts, and once that sank into
    the floats' underflow it learned a step time from nothing: 0.28-17.6 ms against the
    10 ms shown (session 34)."""
    f = fit()
    feed(f, 0.1, lambda i: (i * 7) % 21, step_s=0.01)
    low = high = f.per_running_s
    for i in range(300_000):
        tokens = (50 + i % 100) * BS
        f.add(tokens, 0, 0.05 + tokens / 1000.0 * (1 + (i * 7919) % 13 / 1300))
        low, high = min(low, f.per_running_s), max(high, f.per_running_s)
        assert math.isfinite(f.slowdown) and f.slowdown >= 0.0
    # the step time stays what the running counts showed (0.01 s); the slowdown may go
    # to 0 as their spread fades (its two-standard-error test), which the run showed
    assert 0.005 < low <= high < 0.02


def test_a_few_noisy_observations_do_not_make_a_slowdown() -> None:
    """Eight prefills on an idle fleet, two of them beside a running request and slow
    for another reason: the slope is not two standard errors from 0, so no slowdown."""
    f = fit()
    for i, (tokens, running, service) in enumerate(
        [(800, 0, 0.85), (1600, 0, 1.62), (1200, 1, 3.9), (400, 0, 0.46), (2000, 0, 2.04),
         (900, 1, 0.2), (1500, 0, 1.55), (700, 0, 0.74)]
    ):  # fmt: skip
        f.add(tokens, running, service)
        assert f.slowdown == 0.0, i


def test_only_a_pod_with_nothing_queued_waiting_or_short_of_room_is_clean() -> None:
    idle = PodView(pod="a", running=3, capacity_blocks=100, kv_usage=0.5)
    assert clean_running(idle, prompt_blocks=10) == 3
    assert clean_running(PodView(pod="a", inflight=2), prompt_blocks=10) == 2
    assert clean_running(PodView(pod="a", outstanding_prefill_tokens=5), 10) == -1
    assert clean_running(PodView(pod="a", waiting=1), 10) == -1
    full = PodView(pod="a", running=3, capacity_blocks=100, kv_usage=0.95)
    assert clean_running(full, prompt_blocks=10) == -1  # 5 free blocks, 10 needed


def test_a_first_token_behind_another_pending_one_is_not_fed_to_the_slowdown() -> None:
    """Routed at 1.0 while the pod's previous request had its first token at 2.0: the
    service is partly that request's, so the slowdown fit does not see it."""
    rate, f = PrefillRate(5000.0), fit()
    assert rate.first_token("p", 0.0, 2.0, 100.0, running=0, slowdown=f) is None
    before = f._n  # the fit's (forgetting) count of observations
    assert rate.first_token("p", 1.0, 3.0, 100.0, running=5, slowdown=f) is None
    assert f._n == before
    assert rate.first_token("p", 4.0, 4.5, 100.0, running=5, slowdown=f) is None
    assert f._n > before


def req(rid: str, blocks: int) -> RouteRequest:
    return RouteRequest(
        request_id=rid,
        model="m",
        prompt_tokens=blocks * BS,
        block_keys=[hash((rid, k)) for k in range(blocks)],
        block_size=BS,
    )


def test_cost_learns_the_slowdown_it_is_not_given_and_scores_with_it() -> None:
    policy = build_policy("cost", {"decode_slowdown_per_running": None, "kv_admission": False})
    clock = ManualClock()
    policy.clock = clock
    for i in range(1000):
        running = (i * 7) % 21
        r = req(f"r{i}", 50 + i % 100)
        policy.pick(r, [PodView(pod="p0", running=running)])
        policy.on_routed(r, "p0")
        clock.now += 0.05 + r.prompt_tokens / 1000.0 * (1.0 + 0.1 * running)
        policy.on_first_token(r, "p0", 0.0)
        policy.on_complete(r, "p0")
        clock.now += 1.0
    assert policy.learned()["decode_slowdown_per_running", "m"] == pytest.approx(0.1, rel=0.01)
    scores = policy.pick(
        req("next", 100), [PodView(pod="idle", running=0), PodView(pod="busy", running=10)]
    ).scores
    assert scores["busy"] > 1.8 * scores["idle"]


def learn_steps(policy: object, step_s: float) -> None:
    """Clean first tokens whose service grows by ``step_s`` per running request and
    not with the prompt's tokens times the running count (no slowdown)."""
    clock = ManualClock()
    policy.clock = clock  # type: ignore[attr-defined]
    for i in range(1000):
        running = (i * 7) % 21
        r = req(f"r{i}", 50 + i % 100)
        policy.pick(r, [PodView(pod="p0", running=running)])  # type: ignore[attr-defined]
        policy.on_routed(r, "p0")  # type: ignore[attr-defined]
        clock.now += 0.05 + step_s * running + r.prompt_tokens / 1000.0
        policy.on_first_token(r, "p0", 0.0)  # type: ignore[attr-defined]
        policy.on_complete(r, "p0")  # type: ignore[attr-defined]
        clock.now += 1.0


def test_cost_charges_a_step_of_the_running_decodes_per_waiting_request_and_its_own() -> None:
    """A pod with 10 running and 3 waiting requests pays 4 steps x 10 running x the
    learned 10 ms beside an idle pod: the newcomer's own prefill step and one for each
    request ahead of it, every one lengthened by the running decodes."""
    policy = build_policy("cost", {"decode_slowdown_per_running": None, "kv_admission": False})
    learn_steps(policy, 0.01)
    learned = policy.learned()
    step = learned["step_seconds_per_running", "m"]
    assert step == pytest.approx(0.01, rel=0.02)
    assert learned["decode_slowdown_per_running", "m"] == 0.0
    idle, busy = PodView(pod="idle"), PodView(pod="busy", running=10, waiting=3)
    scores = policy.pick(req("next", 100), [idle, busy]).scores
    assert scores["busy"] - scores["idle"] == pytest.approx(4 * 10 * step)
    # unscraped: the router's in-flight count stands for the running requests
    guessed = policy.pick(req("n2", 100), [idle, PodView(pod="b", inflight=5)]).scores
    assert guessed["b"] - guessed["idle"] == pytest.approx(5 * step)


def test_the_step_charge_is_off_when_switched_off_or_the_slowdown_is_told() -> None:
    off = build_policy(
        "cost",
        {"decode_slowdown_per_running": None, "kv_admission": False, "charge_decode_steps": False},
    )
    told = build_policy("cost", {"decode_slowdown_per_running": 0.0, "kv_admission": False})
    for policy in (off, told):
        learn_steps(policy, 0.01)
        assert ("step_seconds_per_running", "m") not in policy.learned()
        scores = policy.pick(
            req("next", 100), [PodView(pod="idle"), PodView(pod="busy", running=10, waiting=3)]
        ).scores
        assert scores["busy"] == scores["idle"]


def test_cost_keeps_a_slowdown_it_is_given() -> None:
    policy = build_policy("cost", {"decode_slowdown_per_running": 0.5})
    r = req("a", 100)
    policy.pick(r, [PodView(pod="p0", running=4)])
    policy.on_routed(r, "p0")
    policy.on_first_token(r, "p0", 0.0)
    assert ("decode_slowdown_per_running", "m") not in policy.learned()


def test_between_refits_the_slowdown_holds_and_each_refit_sees_every_observation() -> None:
    """The sums take every observation; the slope is solved on each of the first
    REFIT_EVERY and then on every REFIT_EVERY-th, from all of them."""
    assert 1000 % REFIT_EVERY == 0  # the 1,000th observation is solved
    every = fit()
    feed(every, 0.1, lambda i: (i * 7) % 21, n=1000)
    held = every.slowdown
    assert held == pytest.approx(0.1, rel=0.01)
    slower = [(800 + 16 * i, (7 * i) % 21) for i in range(1000, 1000 + REFIT_EVERY)]
    for tokens, running in slower[:-1]:  # slowed by 0.3 each: no solve, the slowdown holds
        every.add(tokens, running, 0.05 + tokens / 1000.0 * (1.0 + 0.3 * running))
        assert every.slowdown == held
    tokens, running = slower[-1]  # the REFIT_EVERY-th: solved, with all of them
    every.add(tokens, running, 0.05 + tokens / 1000.0 * (1.0 + 0.3 * running))
    assert every.slowdown > held
