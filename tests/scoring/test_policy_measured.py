"""The ``measured`` policy: rates learned from observations, misses priced by the delay
they cause, cache room as vLLM has it, bad calibration input ignored."""

from __future__ import annotations

import logging
import math

import pytest

from scoring.policies import PodView, RouteRequest, build_policy
from scoring.policies.measured import MeasuredPolicy, free_blocks
from scoring.policies.pod_rates import PodRates, Priors
from scoring.replay.engine import replay_policy
from scoring.replay.families import generate
from scoring.replay.simpod import FleetConfig
from tests.support.clock import ManualClock

BS = 16


def req(rid: str, keys: list[int] | None = None, prompt: int | None = None) -> RouteRequest:
    keys = keys if keys is not None else []
    return RouteRequest(
        request_id=rid,
        model="m",
        prompt_tokens=prompt if prompt is not None else max(1, len(keys) * BS),
        block_keys=keys,
        block_size=BS,
    )


def policy(**params: object) -> tuple[MeasuredPolicy, ManualClock]:
    pol = build_policy("measured", params)
    assert isinstance(pol, MeasuredPolicy)
    clock = ManualClock()
    pol.clock = clock
    return pol, clock


def serve(
    pol: MeasuredPolicy,
    clock: ManualClock,
    pod: str,
    rid: str,
    tokens: int,
    seconds: float,
    *,
    output: int = 1,
    step_s: float = 0.0,
) -> None:
    """Route a cold request of ``tokens`` to an idle ``pod``: first token after
    ``seconds``, then ``output - 1`` decode steps of ``step_s``."""
    r = req(rid, prompt=tokens)
    pol.pick(r, [PodView(pod=pod)])
    pol.on_routed(r, pod)
    clock.now += seconds
    pol.on_first_token(r, pod, seconds)
    clock.now += step_s * max(0, output - 1)
    pol.on_finished(r, pod, output)
    pol.on_complete(r, pod)
    clock.now += 1.0  # idle gap: the next one finds the pod idle


def test_learning_converges_to_a_pods_true_prefill_rate() -> None:
    pol, clock = policy(prefill_rate_tokens_per_s=5000)
    for i in range(500):
        tokens = 1000 + 97 * (i % 20)
        serve(pol, clock, "a", f"r{i}", tokens, tokens / 12_000 + 0.01)
    c, a, _ = pol.rates["a"].prefill.theta
    assert 1 / a == pytest.approx(12_000, rel=0.02)
    assert c == pytest.approx(0.01, abs=0.002)


def test_learning_converges_to_a_pods_decode_step_cost() -> None:
    pol, clock = policy(decode_step_s=0.1)
    for i in range(400):
        serve(pol, clock, "a", f"r{i}", 100, 0.05, output=50, step_s=0.02)
    assert pol.rates["a"].decode_step_s(0) == pytest.approx(0.02, rel=0.02)


def test_priors_hold_until_data_arrives() -> None:
    pol, _ = policy(prefill_rate_tokens_per_s=4000, decode_step_s=0.03)
    rates = pol.pod_rates("new")
    assert rates.token_s(0) == pytest.approx(1 / 4000)
    assert rates.decode_step_s(0) == pytest.approx(0.03)
    assert rates.arrival_rate(10.0) == 0.0
    assert rates.utilisation(10.0) == 0.0


def test_a_pod_full_of_old_free_cache_is_not_treated_as_full() -> None:
    # both caches hold every block, but only "clean"'s are held by running requests:
    # "stale" is full of old, unrelated, evictable blocks and has the room
    stale = PodView(pod="stale", kv_usage=0.05, resident_blocks=1000, capacity_blocks=1000)
    clean = PodView(pod="clean", kv_usage=0.50, resident_blocks=500, capacity_blocks=1000)
    assert free_blocks(stale) == pytest.approx(950)
    assert free_blocks(clean) == pytest.approx(500)
    pol, _ = policy()
    chosen = {pol.pick(req(f"r{i}", [1000 + i]), [stale, clean]).pod for i in range(20)}
    assert chosen == {"stale"}


def test_two_pods_one_slow_the_slow_one_is_learned_and_avoided() -> None:
    pol, clock = policy(prefill_rate_tokens_per_s=5000)
    for i in range(400):
        tokens = 1000 + 100 * (i % 10)  # sizes vary: the data identify rate and overhead
        serve(pol, clock, "fast", f"f{i}", tokens, tokens / 10_000)
        serve(pol, clock, "slow", f"s{i}", tokens, tokens / 2_000)
    assert 1 / pol.rates["fast"].token_s(0) == pytest.approx(10_000, rel=0.05)
    assert 1 / pol.rates["slow"].token_s(0) == pytest.approx(2_000, rel=0.05)
    d = pol.pick(req("x", prompt=3000), [PodView(pod="slow"), PodView(pod="fast")])
    assert d.pod == "fast"
    assert d.scores["slow"] > 4 * d.scores["fast"]


def test_a_decode_heavy_pod_is_charged_for_the_prefill_it_slows() -> None:
    pol, clock = policy()
    # both pods: 5000 tok/s alone, each running request slows prefill by 10%
    for i in range(120):
        running = i % 12
        for pod in ("a", "b"):
            r = req(f"{pod}{i}", prompt=2000)
            view = PodView(pod=pod, running=running)
            pol.pick(r, [view])
            pol.on_routed(r, pod)
            clock.now += 2000 / 5000 * (1 + 0.1 * running)
            pol.on_first_token(r, pod, 0.0)
            pol.on_complete(r, pod)
    assert pol.rates["a"].slowdown_s_per_token() / pol.rates["a"].token_s(0) == pytest.approx(
        0.1, rel=0.05
    )
    busy = PodView(pod="a", running=30)
    quiet = PodView(pod="b", running=2)
    d = pol.pick(req("x", prompt=2000), [busy, quiet])
    assert d.pod == "b"
    assert d.scores["a"] > d.scores["b"] * 1.5


@pytest.mark.parametrize("bad", [math.nan, -1.0, math.inf])
def test_nan_or_negative_observations_are_ignored_counted_and_logged_once(
    bad: float, caplog: pytest.LogCaptureFixture
) -> None:
    pol, _ = policy(prefill_rate_tokens_per_s=5000)
    before = pol.pod_rates("a").prefill.theta
    with caplog.at_level(logging.WARNING, logger="scoring.policies.pod_rates"):
        for i in range(3):
            r = req(f"r{i}", prompt=100)
            pol.pick(r, [PodView(pod="a")])
            pol.on_routed(r, "a")
            pol.on_first_token(r, "a", bad)
            pol.on_finished(r, "a", -5)
            pol.on_complete(r, "a")
    assert pol.rates["a"].prefill.theta == before
    assert pol.calibration.rejected["ttft"] == 3
    assert pol.calibration.rejected["output tokens"] == 3
    assert sum("ttft" in rec.getMessage() for rec in caplog.records) == 1
    d = pol.pick(req("x", prompt=100), [PodView(pod="a"), PodView(pod="b")])
    assert all(math.isfinite(s) for s in d.scores.values())


def test_a_fit_that_keeps_its_prior_is_counted_apart_not_as_bad_input(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # larger prompts answered faster: every observation is valid, but the least-squares
    # slope comes out negative, so the prefill fit keeps its prior
    pol, clock = policy(prefill_rate_tokens_per_s=5000)
    prior = pol.pod_rates("a").prefill.theta
    with caplog.at_level(logging.WARNING, logger="scoring.policies.pod_rates"):
        for i, tokens in enumerate([100, 2000, 4000, 8000] * 10):
            serve(pol, clock, "a", f"r{i}", tokens, 2.0 - tokens / 8000)
    assert pol.rates["a"].prefill.theta == prior
    assert pol.calibration.prior_fallbacks["prefill"] > 0
    assert not pol.calibration.rejected  # no observation was bad
    assert pol.rejected_observations() == {}
    assert not caplog.records


def test_a_clock_running_backwards_is_rejected_not_learned() -> None:
    pol, clock = policy()
    clock.now = 10.0
    r = req("r", prompt=100)
    pol.pick(r, [PodView(pod="a")])
    pol.on_routed(r, "a")
    clock.now = 5.0
    pol.on_first_token(r, "a", 0.1)
    assert pol.calibration.rejected["clock"] == 1
    assert pol.rates["a"].prefill.observations == 0


def test_a_pod_that_never_answers_keeps_its_priors_and_its_queue_repels() -> None:
    pol, clock = policy(prefill_rate_tokens_per_s=5000)
    for i in range(10):
        r = req(f"r{i}", prompt=1000)
        pol.pick(r, [PodView(pod="mute")])
        pol.on_routed(r, "mute")
        clock.now += 0.1
    assert pol.rates["mute"].token_s(0) == pytest.approx(1 / 5000)
    d = pol.pick(req("x", prompt=1000), [PodView(pod="mute"), PodView(pod="other")])
    assert d.pod == "other"
    assert all(math.isfinite(s) for s in d.scores.values())


def test_a_miss_costs_more_where_requests_will_queue_behind_it() -> None:
    pol, clock = policy(prefill_rate_tokens_per_s=5000)
    # "busy" receives a request every 0.2 s, "calm" every 2 s
    for i in range(30):
        serve(pol, clock, "busy", f"b{i}", 500, 0.1)
        clock.now -= 0.9
        if i % 10 == 0:
            serve(pol, clock, "calm", f"c{i}", 500, 0.1)
            clock.now -= 1.0
    busy, calm = pol.rates["busy"], pol.rates["calm"]
    assert busy.arrival_rate(clock.now) > 3 * calm.arrival_rate(clock.now)
    d = pol.pick(req("x", prompt=5000), [PodView(pod="busy"), PodView(pod="calm")])
    assert d.pod == "calm"


def test_every_queued_request_pays_the_pods_learned_per_request_time() -> None:
    """'a' has learned that a request costs it 0.5 s beyond its tokens (in the replay:
    hits the router counted that were evicted before the request ran); six queued
    requests predicted all-hit still make a 3 s queue, so a small miss on idle 'b' wins."""
    pol, clock = policy(prefill_rate_tokens_per_s=5000)
    for i in range(200):
        tokens = 200 + 300 * (i % 13)
        serve(pol, clock, "a", f"w{i}", tokens, 0.5 + tokens / 5000)
    c = pol.rates["a"].prefill.theta[0]
    assert c == pytest.approx(0.5, abs=0.02)
    keys = list(range(100))
    for i in range(6):  # queued on 'a', every block predicted cached, never answered
        r = req(f"q{i}", keys)
        pol.pick(r, [PodView(pod="a", hits={"GPU": 100})])
        pol.on_routed(r, "a")
    d = pol.pick(req("x", keys), [PodView(pod="a", hits={"GPU": 100}), PodView(pod="b")])
    assert d.scores["a"] >= 6 * c
    assert d.pod == "b"


def test_when_the_whole_fleet_queues_a_miss_is_charged_for_the_fleets_followers() -> None:
    """'a' and 'c' take a request every 0.1 s, 'b' one a second, none answered: every
    pod has a queue.  'a' holds the prompt (1.6 s queue), 'b' would miss it (0.32 s of
    work behind a 0.16 s queue).  Counting only b's own followers, b wins; but the
    router spreads the fleet's later arrivals, so the work delays the fleet's followers
    (``N_fleet``), and the hit on 'a' costs less delay."""
    picks = {}
    for pooled in (False, True):
        pol, clock = policy(prefill_rate_tokens_per_s=5000, pooled_delay=pooled)
        for i in range(20):
            for pod in ("a", "c", "b") if i % 10 == 0 else ("a", "c"):
                r = req(f"{pod}{i}", prompt=400)
                pol.pick(r, [PodView(pod=pod)])
                pol.on_routed(r, pod)
            clock.now += 0.1
        views = [PodView(pod="a", hits={"GPU": 100}), PodView(pod="b"), PodView(pod="c")]
        picks[pooled] = pol.pick(req("x", list(range(100))), views).pod
    assert picks == {False: "b", True: "a"}


def test_a_hit_beats_a_miss_on_an_equally_loaded_fleet() -> None:
    pol, _ = policy()
    keys = list(range(64))
    views = [PodView(pod="hit", hits={"GPU": 60}), PodView(pod="cold")]
    assert pol.pick(req("r", keys), views).pod == "hit"


def test_a_miss_that_pushes_hot_blocks_out_pays_their_recompute() -> None:
    """Both pods idle and cold for the request; p0's cache (20 blocks) is full of blocks
    routed there a moment ago (a conversation in progress), p1's is empty: the 8 blocks
    computed on p0 would evict 8 hot ones, each a recompute a later request pays."""
    pol, clock = policy()
    warm = req("warm", list(range(20)))
    pol.pick(warm, [PodView(pod="p0", capacity_blocks=20)])
    pol.on_routed(warm, "p0")
    pol.on_complete(warm, "p0")
    clock.now += 1.0
    views = [
        PodView(pod="p0", resident_blocks=20, capacity_blocks=20, kv_usage=0.0),
        PodView(pod="p1", resident_blocks=20, capacity_blocks=20, kv_usage=0.0),
    ]
    d = pol.pick(req("new", list(range(100, 108))), views)
    assert d.pod == "p1"
    assert d.detail["evicted_hot_blocks"] == {"p0": 8}
    assert d.scores["p0"] == pytest.approx(d.scores["p1"] + 8 * BS / 5000.0)
    # hot tracking off: the two pods tie (equal free room) and no eviction is charged
    off, _ = policy(hot_window_s=0.0)
    off.on_routed(warm, "p0")
    off.on_complete(warm, "p0")
    d = off.pick(req("new", list(range(100, 108))), views)
    assert d.detail["evicted_hot_blocks"] == {} and d.scores["p0"] == d.scores["p1"]


def test_rates_fit_stays_finite_on_degenerate_input() -> None:
    rates = fresh_pod()
    for _ in range(50):  # zero tokens, zero time: nothing identifies the rate
        rates.first_token(0.0, 0.0, 0.0, 0.0)
    assert rates.token_s(0) > 0 and math.isfinite(rates.token_s(0))


def fresh_pod() -> PodRates:
    """A pod's rates at their priors (5,000 tokens/s, 25 ms a decode step), memory 64."""
    return PodRates(
        Priors(
            prefill_rate_tokens_per_s=5000,
            prefill_slowdown_per_running=0.0,
            request_overhead_s=0.0,
            decode_step_s=0.025,
            decode_step_per_running_s=0.0,
            memory=64,
            prior_weight=4,
        )
    )


def learned_pod() -> PodRates:
    """A pod shown a spread of prompt sizes, running and decoding requests: 12,000
    tokens/s, 10 ms a request, 5% slower prefill and 1 ms longer steps per request."""
    rates = fresh_pod()
    for i in range(1000):
        serve_pod(rates, 2.0 * i, 200 + 300 * (i % 13), i % 5, i % 7)
    return rates


def serve_pod(rates: PodRates, at: float, tokens: int, running: int, decoding: int) -> None:
    service = 0.01 + tokens / 12_000 * (1 + 0.05 * running)
    rates.first_token(at, at + service, tokens, running)
    rates.finished(49 * (0.02 + 0.001 * decoding), 49, decoding)


@pytest.mark.parametrize("hit_tokens", [5, 0])
def test_a_long_run_of_one_prompt_size_keeps_the_learned_prefill_rate(hit_tokens: int) -> None:
    """A load test's one prompt, all hits: one size cannot tell the rate from the
    per-request time.  Solved anyway, the ridge floor split 5-token ones' service into
    810 tokens/s, and 0-token ones fell back to the 5,000 prior once the earlier spread
    had faded (about 3,000 on).  50,000 take its sums past underflow (about 48,000)."""
    rates = learned_pod()
    assert 1 / rates.token_s(0) == pytest.approx(12_000, rel=0.01)
    low = high = 12_000.0
    for i in range(50_000):
        at = 2_000.0 + 2.0 * i
        jitter = 0.002 * ((i * 7919) % 13 / 13)  # the service time varies, the size not
        rates.first_token(at, at + jitter + 0.01 + hit_tokens / 12_000, hit_tokens, i % 5)
        if i % 64 == 0:
            rate = 1 / rates.token_s(0)
            low, high = min(low, rate), max(high, rate)
    assert 12_000 / 1.5 < low <= high < 12_000 * 1.5


def test_an_idle_spell_keeps_the_learned_slowdowns() -> None:
    """Nothing running or decoding for 50,000 requests cannot tell what a running
    request costs: the slowdowns learned before stay (they had faded to the priors)."""
    rates = learned_pod()
    slowdown = rates.slowdown_s_per_token() / rates.token_s(0)
    per_decoding = rates.decode_step_s(1) - rates.decode_step_s(0)
    assert slowdown == pytest.approx(0.05, rel=0.05)
    assert per_decoding == pytest.approx(0.001, rel=0.05)
    for i in range(50_000):
        serve_pod(rates, 2_000.0 + 2.0 * i, 200 + 300 * (i % 13), 0, 0)
    assert rates.slowdown_s_per_token() / rates.token_s(0) == pytest.approx(slowdown, rel=0.01)
    assert rates.decode_step_s(1) - rates.decode_step_s(0) == pytest.approx(per_decoding, rel=0.01)
    assert 1 / rates.token_s(0) == pytest.approx(12_000, rel=0.01)


def test_deterministic_across_replays() -> None:
    trace = generate("chat", 3, block_size=BS)
    trace.requests = trace.requests[:300]
    cfg = FleetConfig(pods=4, capacity_tokens=40_000, block_size=BS, prefill_rate=8000)
    runs = [replay_policy(trace, build_policy("measured"), cfg) for _ in range(2)]
    assert runs[0].pod_of == runs[1].pod_of
    assert runs[0].ttft_s == runs[1].ttft_s
    assert len(set(runs[0].pod_of)) == 4


def test_the_replay_feeds_the_hooks_in_virtual_time() -> None:
    trace = generate("chat", 1, block_size=BS)
    trace.requests = trace.requests[:200]
    cfg = FleetConfig(pods=2, capacity_tokens=40_000, block_size=BS, prefill_rate=8000)
    pol = build_policy("measured", {"prefill_rate_tokens_per_s": 1000})
    assert isinstance(pol, MeasuredPolicy)
    own_clock = pol.clock
    replay_policy(trace, pol, cfg)
    assert pol.clock is own_clock  # restored after the replay
    learned = [1 / r.token_s(0) for r in pol.rates.values()]
    # the simulated pods prefill 8000 tok/s (slowed a little by decodes): learned, not
    # the 1000 tok/s prior
    assert all(5000 < x < 9000 for x in learned), learned
    assert not pol.calibration.rejected
