"""``cost``'s opt-in ``count_arrivals``: a miss also delays the requests that the pod's
cache binds to it and that arrive while the miss's prefill runs."""

from __future__ import annotations

import pytest

from scoring.policies import PodView, RouteRequest, build_policy
from scoring.policies.cost import CostPolicy
from tests.support.clock import ManualClock

BS = 16


def policy(clock: ManualClock, **params: object) -> CostPolicy:
    p = build_policy("cost", {"count_arrivals": True, "learn_prefill_rate": False, **params})
    assert isinstance(p, CostPolicy)
    p.clock = clock
    return p


def req(rid: str, keys: list[int], extra: int = 0) -> RouteRequest:
    return RouteRequest(rid, "m", len(keys) * BS + extra, keys, BS)


def route_hits(p: CostPolicy, clock: ManualClock, pod: str, n: int, every_s: float) -> None:
    """``n`` requests, one every ``every_s`` seconds, each holding half its prompt on
    ``pod``, routed there and completed."""
    for i in range(n):
        r = req(f"h{pod}{i}", [7, 8, 9, 10 + i])
        d = p.pick(r, [PodView(pod, hits={"GPU": 2}), PodView("other")])
        assert d.detail["cached_tokens"][pod] == 2 * BS
        p.on_routed(r, pod)
        p.on_complete(r, pod)
        clock.now += every_s


def test_the_bound_arrival_rate_is_the_routing_rate_times_the_share_held() -> None:
    clock = ManualClock(100.0)
    p = policy(clock)
    route_hits(p, clock, "a", 5, 0.5)
    clock.now -= 0.5  # at the last routing: no gap open
    # 2 routings a second, each with half its prompt held on the pod
    assert p.bound_arrival_rate("a", clock.now) == pytest.approx(2.0 * 0.5)
    assert p.bound_arrival_rate("never-routed", clock.now) == 0.0


def test_a_pod_that_stops_receiving_traffic_cools_without_a_timer() -> None:
    clock = ManualClock(100.0)
    p = policy(clock)
    route_hits(p, clock, "a", 5, 0.5)
    clock.now += 9.5  # 10 s since the last routing: the open gap bounds the mean
    assert p.bound_arrival_rate("a", clock.now) == pytest.approx(0.5 / 10.0)


def test_a_miss_costs_more_where_the_cache_binds_arrivals_to_the_pod() -> None:
    clock = ManualClock(100.0)
    p = policy(clock)
    route_hits(p, clock, "a", 8, 0.25)
    long = req("long", list(range(1000, 1200)))  # 3,200 tokens, cached nowhere
    views = [PodView("a"), PodView("b")]
    d = p.pick(long, views)
    rate = p.params.prefill_rate_tokens_per_s  # type: ignore[attr-defined]
    lam = p.bound_arrival_rate("a", clock.now)
    assert lam > 0.0 and p.bound_arrival_rate("b", clock.now) == 0.0
    # the miss weight gains lambda * the miss's prefill seconds on "a" only
    base = d.detail["miss_weight"]["b"]
    assert d.detail["miss_weight"]["a"] == pytest.approx(base + lam * long.prompt_tokens / rate)
    assert d.pod == "b"
    # without the option the two pods tie on the same miss weight
    off = build_policy("cost", {"learn_prefill_rate": False})
    off.clock = clock
    d_off = off.pick(long, views)
    assert d_off.detail["miss_weight"]["a"] == d_off.detail["miss_weight"]["b"]


def test_requests_that_hit_nothing_add_no_bound_arrivals() -> None:
    clock = ManualClock(100.0)
    p = policy(clock)
    for i in range(6):
        r = req(f"m{i}", [500 + i, 600 + i])
        p.pick(r, [PodView("a"), PodView("b")])
        p.on_routed(r, "a")
        p.on_complete(r, "a")
        clock.now += 0.5
    assert p.bound_arrival_rate("a", clock.now) == 0.0


def test_a_removed_pod_forgets_its_arrivals() -> None:
    clock = ManualClock(100.0)
    p = policy(clock)
    route_hits(p, clock, "a", 4, 0.5)
    p.on_pod_removed("a")
    assert p.bound_arrival_rate("a", clock.now) == 0.0
