"""P/D decisions: the decode pod by load, the prefill pod by the cache-aware policy over
the prefill pool only, and the split decision (short prompts and busy prefill pools go
direct)."""

from __future__ import annotations

import pytest

from scoring.pd import PDParams, PDRouter
from scoring.policies.base import PodView, RouteRequest
from scoring.policies.registry import build_policy
from scoring.policies.round_robin import RoundRobinPolicy

BS = 16


def req(prompt_tokens: int, rid: str = "r1", max_tokens: int | None = 64) -> RouteRequest:
    n_blocks = prompt_tokens // BS
    return RouteRequest(
        request_id=rid,
        model="m",
        prompt_tokens=prompt_tokens,
        block_keys=list(range(n_blocks)),
        block_size=BS,
        max_tokens=max_tokens,
    )


def view(pod: str, gpu_blocks: int = 0, **kw: object) -> PodView:
    return PodView(pod=pod, hits={"GPU": gpu_blocks}, **kw)  # type: ignore[arg-type]


def router(**params: object) -> PDRouter:
    return PDRouter(build_policy("cost"), PDParams.model_validate(params))


def test_the_decode_pod_is_the_least_loaded_by_running_requests_and_kv_usage() -> None:
    r = router()
    decode = [
        view("d0", running=8, kv_usage=0.2),
        view("d1", running=2, kv_usage=0.9),
        view("d2", running=2, kv_usage=0.1),
    ]
    d = r.pick(req(4096), [view("p0")], decode)
    assert d.decode_pod == "d2"
    assert d.decode_scores["d0"] > d.decode_scores["d1"] > d.decode_scores["d2"]


def test_a_decode_pod_without_room_for_the_request_is_avoided() -> None:
    r = router()
    full = view("d0", running=0, kv_usage=0.99, capacity_blocks=100)
    roomy = view("d1", running=3, kv_usage=0.5, capacity_blocks=10_000)
    assert r.pick(req(4096), [view("p0")], [full, roomy]).decode_pod == "d1"


def test_decode_ties_go_to_the_pod_holding_more_of_the_prompt() -> None:
    r = router()
    d = r.pick(req(4096), [view("p0")], [view("d0", 2), view("d1", 40), view("d2", 10)])
    assert d.decode_pod == "d1"


def test_a_short_uncached_remainder_goes_direct_to_the_decode_pod() -> None:
    r = router(min_uncached_tokens=256)
    short = r.pick(req(200), [view("p0")], [view("d0")])
    assert (short.split, short.reason, short.decode_pod) == (False, "short", "d0")
    # a long prompt the decode pod already holds leaves a short remainder too
    held = r.pick(req(4096), [view("p0")], [view("d0", gpu_blocks=250)])
    assert held.reason == "short" and held.predicted["uncached_decode_tokens"] == 96


def test_a_long_prompt_on_a_busy_decode_pod_is_split_to_the_cache_holding_prefill_pod() -> None:
    r = router()
    d = r.pick(
        req(8192),
        [view("p0"), view("p1", gpu_blocks=400), view("p2")],
        [view("d0", running=16)],
    )
    assert (d.split, d.prefill_pod, d.decode_pod, d.reason) == (True, "p1", "d0", "split")
    assert d.predicted["hop_cost_s"] < d.predicted["local_cost_s"]


def test_a_long_uncached_prompt_on_an_idle_fleet_is_split_by_default() -> None:
    # nothing cached, nothing running: the hop costs the pull and one request, the local
    # prefill its whole computation on the decode pod
    d = router().pick(req(2048), [view("p0"), view("p1")], [view("d0"), view("d1")])
    assert (d.split, d.reason) == (True, "split")
    assert d.predicted["hop_cost_s"] < 0.02 < d.predicted["local_cost_s"]


def test_the_shortest_prompt_that_splits_on_an_idle_fleet_is_the_threshold() -> None:
    r = router()
    assert r.pick(req(255), [view("p0")], [view("d0")]).reason == "short"
    assert r.pick(req(256), [view("p0")], [view("d0")]).reason == "split"


def test_a_backed_up_prefill_pool_sends_the_request_direct_even_from_an_idle_decode_pod() -> None:
    # 200k queued tokens = 40 s at the default rate, a local prefill of 8k tokens 1.6 s
    queued = [view("p0", outstanding_prefill_tokens=200_000)]
    d = router().pick(req(8192), queued, [view("d0", running=0)])
    assert (d.split, d.reason) == (False, "local_faster")
    assert d.predicted["hop_cost_s"] > d.predicted["local_cost_s"]


def test_a_prefill_queue_shorter_than_the_local_prefill_still_splits() -> None:
    # 4k queued tokens (0.8 s) ahead on the prefill pod against 1.6 s of local prefill
    queued = [view("p0", outstanding_prefill_tokens=4096)]
    assert router().pick(req(8192), queued, [view("d0")]).split


def test_a_decode_pod_holding_what_the_prefill_pod_lacks_prefills_locally() -> None:
    # D holds 6k of the 8k tokens, P none: P would compute 6k more than D's 2k remainder
    d = router().pick(req(8192), [view("p0")], [view("d0", gpu_blocks=384)])
    assert d.reason == "local_faster"
    assert d.predicted["uncached_prefill_tokens"] - d.predicted["uncached_decode_tokens"] == 6144


def test_the_decode_pod_is_never_its_own_prefill_pod_and_an_empty_pool_goes_direct() -> None:
    both = view("b0", running=8)
    d = router().pick(req(8192), [both], [both])
    assert (d.decode_pod, d.prefill_pod, d.reason) == ("b0", None, "no_prefill_pod")


def test_the_prefill_policy_hears_only_split_requests_routed_to_the_prefill_pool() -> None:
    rr = RoundRobinPolicy()
    r = PDRouter(rr, PDParams())
    pool = [view("p0"), view("p1")]
    decode = [view("d0", running=32)]
    picks = []
    for i in range(4):
        rq = req(8192, rid=f"r{i}")
        d = r.pick(rq, pool, decode)
        r.on_routed(rq, d)
        picks.append(d.prefill_pod)
        r.on_prefill_complete(rq, d)
    assert picks == ["p0", "p1", "p0", "p1"]


def test_pd_params_reject_unknown_fields() -> None:
    with pytest.raises(ValueError, match="min_uncached"):
        PDParams.model_validate({"min_uncached": 3})


def test_no_decode_pod_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no decode-capable pod"):
        router().pick(req(100), [view("p0")], [])


def test_a_prefill_queue_of_predicted_cache_hits_is_not_counted_as_backlog() -> None:
    # the cost policy sent p0 a request whose 8,192 tokens it holds but for 192: 40,000
    # outstanding prompt tokens there weigh as ~940 queued tokens (0.19 s), not 8 s
    warm = req(8192, rid="warm")
    cost = router()
    first = cost.pick(warm, [view("p0", gpu_blocks=500)], [view("d0")])
    assert first.prefill_pod == "p0"
    cost.on_routed(warm, first)
    busy = [view("p0", gpu_blocks=500, outstanding_prefill_tokens=40_000)]
    assert cost.queued_tokens(busy[0]) == pytest.approx(40_000 * 192 / 8192)
    assert cost.pick(req(8192, rid="next"), busy, [view("d0")]).reason == "split"
    # a prefill policy without a queue prediction counts every outstanding prompt token
    rr = PDRouter(RoundRobinPolicy(), PDParams())
    assert rr.pick(req(8192, rid="next"), busy, [view("d0")]).reason == "local_faster"
