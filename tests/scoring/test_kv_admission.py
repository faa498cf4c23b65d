"""The wait for KV room (scoring/policies/kv_admission.py): a request the free blocks of
a pod cannot hold, with the queue ahead of it, waits for running requests to finish."""

from __future__ import annotations

import math

import pytest

from scoring.policies import PodView, Policy, RouteRequest, build_policy
from scoring.policies.kv_admission import WINDOW, DecodeTimes, admission_wait


def view(**kw: object) -> PodView:
    return PodView(pod="p", **kw)  # type: ignore[arg-type]


def test_a_request_that_fits_in_the_free_blocks_does_not_wait() -> None:
    # 1,000 blocks, 60% held: 400 free
    assert admission_wait(view(capacity_blocks=1000, kv_usage=0.6, running=3), 400, 2.0) == 0.0


def test_a_deficit_waits_for_as_many_finishes_as_free_it() -> None:
    pod = view(capacity_blocks=1000, kv_usage=0.9, running=3)  # 100 free, 300 per run
    # 250 short: one finish frees it, the first of three comes after 1/4 of a decode
    assert admission_wait(pod, 350, 2.0) == pytest.approx(0.5)
    # 500 short: two finishes
    assert admission_wait(pod, 600, 2.0) == pytest.approx(1.0)
    # more than every running request holds: at most one whole decode time
    assert admission_wait(pod, 5000, 2.0) == pytest.approx(2.0)


def test_without_what_it_needs_to_know_the_wait_is_zero() -> None:
    full = {"capacity_blocks": 1000, "kv_usage": 0.99, "running": 4}
    assert admission_wait(view(**full), 500, 0.0) == 0.0  # no decode time learned yet
    assert admission_wait(view(**{**full, "capacity_blocks": None}), 500, 2.0) == 0.0
    assert admission_wait(view(**{**full, "kv_usage": None}), 500, 2.0) == 0.0
    assert admission_wait(view(**{**full, "running": 0}), 500, 2.0) == 0.0


def test_decode_times_average_what_they_see_and_ignore_nonsense() -> None:
    d = DecodeTimes()
    for s in (1.0, 3.0, float("nan"), -1.0, math.inf):
        d.add(s)
    assert d.samples == 2 and d.mean_s == pytest.approx(2.0)
    for _ in range(10 * WINDOW):
        d.add(10.0)
    assert d.mean_s == pytest.approx(10.0, rel=1e-3)  # the old ones are forgotten


def req(rid: str, keys: list[int]) -> RouteRequest:
    return RouteRequest(rid, "m", len(keys) * 16, keys, 16)


def learned_decode_time(decode_s: float, now: list[float], **params: object) -> Policy:
    """A ``cost`` policy (no room tie-break) on clock ``now`` that has learned a decode
    time of ``decode_s`` from one streamed request."""
    policy = build_policy("cost", {"tie_break_by_room": False, **params})
    policy.clock = lambda: now[0]
    now[0] = 0.0
    warm = req("w", [9, 9, 9])
    policy.on_routed(warm, "a")
    policy.on_first_token(warm, "a", 0.1)
    now[0] = decode_s
    policy.on_complete(warm, "a")
    return policy


def test_cost_sends_a_miss_past_a_pod_whose_kv_is_held_by_running_requests() -> None:
    """Two pods with empty queues, one with its cache held by long decodes: with a
    learned decode time, a cold prompt goes to the pod with room; with the rule off,
    both look equal."""
    now = [0.0]
    policy = learned_decode_time(4.0, now)  # kv_admission: the default
    held = view(capacity_blocks=100, kv_usage=0.95, running=2)
    held.pod = "held"
    free = view(capacity_blocks=100, kv_usage=0.10, running=2)
    free.pod = "free"
    cold = req("c", list(range(100, 140)))  # 40 uncached blocks
    decision = policy.pick(cold, [held, free])
    assert decision.pod == "free"
    assert decision.scores["held"] - decision.scores["free"] == pytest.approx(4.0 / 3)
    off = learned_decode_time(4.0, now, kv_admission=False)
    scores = off.pick(cold, [held, free]).scores
    assert scores["held"] == scores["free"]


def test_first_tokens_are_kept_only_for_live_requests_the_policy_routed() -> None:
    """A first token is remembered on the request's live entry (dropped at its end);
    first tokens of requests the policy never routed leave nothing behind."""
    from scoring.policies import cost

    policy = build_policy("cost")
    assert isinstance(policy, cost.CostPolicy)
    for i in range(1000):
        policy.on_first_token(req(f"r{i}", [1]), "a", 0.1)
    assert policy._live == {} and policy.learned() == {}
    r = req("routed", [1])
    policy.on_routed(r, "a")
    policy.on_first_token(r, "a", 0.1)
    policy.on_complete(r, "a")
    assert policy._live == {} and policy._models["m"].decode.samples == 1


def test_a_cached_prefix_no_live_request_holds_needs_room_too() -> None:
    """vLLM takes a hit's cached blocks out of the free pool when it admits the request
    (an evictable computed block counts as a block to allocate): on a pod whose free
    blocks hold the new block but not the 40 cached ones, the request waits, unless a
    live request routed there holds that prefix already."""
    policy = learned_decode_time(3.0, [0.0])
    prefix = list(range(100, 140))
    holder = req("h", prefix)  # live on "shared": it holds the 40 blocks
    policy.on_routed(holder, "shared")
    pods = []
    for name in ("idle", "shared"):  # 20 of 100 blocks free; both caches hold the prefix
        v = view(capacity_blocks=100, kv_usage=0.8, running=2, hits={"GPU": 40})
        v.pod = name
        pods.append(v)
    decision = policy.pick(req("n", [*prefix, 999]), pods)  # 41 blocks, 1 uncached
    assert decision.pod == "shared"
    # "idle": 41 blocks needed, 21 short, one of two runs frees 40: a third of 3 s
    assert decision.scores["idle"] - decision.scores["shared"] == pytest.approx(1.0)


def test_with_kv_held_admitted_a_waiting_request_holds_no_blocks() -> None:
    """vLLM allocates a request's blocks when it admits it, FCFS: a live request still
    waiting (the newest of the pod's scraped ``waiting``) holds none, so a newcomer
    sharing its prefix needs room for all of it.  Admitted (prefilling: no longer among
    the waiting, or past its first token) it holds them and the newcomer shares them;
    at its end they are freed (cached, evictable: room to allocate again)."""
    now = [0.0]
    policy = learned_decode_time(3.0, now, kv_held_admitted=True)
    prefix = list(range(100, 140))
    holder = req("h", prefix)
    policy.on_routed(holder, "shared")

    def gap(waiting: int | None) -> float:
        pods = []
        for name in ("idle", "shared"):  # 20 of 100 blocks free; both caches hold it
            v = view(capacity_blocks=100, kv_usage=0.8, running=2, hits={"GPU": 40})
            v.pod = name
            v.waiting = waiting
            pods.append(v)
        scores = policy.pick(req("n", [*prefix, 999]), pods).scores
        return scores["idle"] - scores["shared"]

    # "idle" needs 41 blocks, 21 short: one of two runs frees 40, a third of 3 s
    assert gap(0) == pytest.approx(1.0)  # nobody waits: the holder is prefilling
    assert gap(None) == pytest.approx(1.0)  # not scraped: counted as admitted
    # the holder is the one waiting: "shared" needs 41 blocks too, after the
    # waiting one's (the queue ahead is admitted first): no better than "idle"
    assert gap(1) <= 0.0
    policy.on_first_token(holder, "shared", 0.1)
    assert gap(1) == pytest.approx(1.0)  # past its first token: admitted
    policy.on_complete(holder, "shared")
    assert gap(0) == pytest.approx(0.0)  # ended: its blocks are free, cached


def test_a_retried_or_removed_holder_leaves_no_admitted_blocks_behind() -> None:
    """The chains of admitted requests are dropped with the request: routed again to
    another pod (a retry), or with its pod gone."""
    from scoring.policies import cost

    now = [0.0]
    policy = learned_decode_time(3.0, now, kv_held_admitted=True)
    assert isinstance(policy, cost.CostPolicy)
    holder = req("h", list(range(100, 140)))
    policy.on_routed(holder, "a")
    policy.on_first_token(holder, "a", 0.1)
    assert policy._admitted.has("a")
    policy.on_routed(holder, "b")  # a retry: the first attempt is forgotten
    assert not policy._admitted.has("a") and not policy._admitted.has("b")
    policy.on_first_token(holder, "b", 0.1)
    assert policy._admitted.has("b")
    policy.on_pod_removed("b")
    assert not policy._admitted.has("b") and policy._queued.pods == {}
