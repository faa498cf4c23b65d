"""While the shared index cannot be read, a request's views carry the prefixes this
replica routed to each pod (the policy's ``routed_prefixes``, router/decision/views.py):
the router keeps sending a conversation where its prefix is rather than routing it as a
stranger.  The index here is a real Redis client whose server refuses connections."""

from __future__ import annotations

from router.decision.views import ViewBuilder
from router.fleet.load import MemoryLoadStore, PendingLoad
from scoring.index.redis import RedisIndex
from scoring.policies import PodView, RouteRequest, build_policy
from tests.support.ports import refused_port

BS = 16
PODS = ["a", "b", "c"]


def req(rid: str, keys: list[int]) -> RouteRequest:
    return RouteRequest(rid, "m", len(keys) * BS, keys, BS)


def gpu(views: dict[str, PodView]) -> dict[str, int]:
    return {pod: v.cached_blocks("GPU") for pod, v in views.items()}


async def test_an_unreadable_index_gives_the_prefixes_this_replica_routed() -> None:
    policy = build_policy("cost")
    policy.on_routed(req("r1", [1, 2, 3, 4]), "a")
    policy.on_routed(req("r2", [1, 2, 9]), "b")
    index = RedisIndex.from_url(f"redis://127.0.0.1:{refused_port()}/0")
    views = ViewBuilder(
        index,
        MemoryLoadStore(),
        None,
        PendingLoad(),
        fallback=policy.routed_prefixes,
    )
    try:
        got = gpu(await views.views([1, 2, 3, 5], PODS))
        assert got == {"a": 3, "b": 2, "c": 0}
        # a prompt nobody routed has no hits anywhere
        assert gpu(await views.views([7, 8], PODS)) == {"a": 0, "b": 0, "c": 0}
        # the fallback is only for a failed lookup: without it nothing is made up
        views.fallback = None
        assert gpu(await views.views([1, 2, 3, 5], PODS)) == {"a": 0, "b": 0, "c": 0}
    finally:
        await index.close()


def test_a_policy_without_a_memory_of_its_routing_offers_no_prefixes() -> None:
    cost_without_hot_set = build_policy("cost", {"hot_window_s": 0})
    cost_without_hot_set.on_routed(req("r1", [1, 2, 3]), "a")
    assert cost_without_hot_set.routed_prefixes([1, 2, 3], PODS) == {}
    least = build_policy("least_load")
    least.on_routed(req("r1", [1, 2, 3]), "a")
    assert least.routed_prefixes([1, 2, 3], PODS) == {}


def test_routed_prefixes_leave_out_pods_without_one_and_expire_with_the_hot_window() -> None:
    policy = build_policy("cost", {"hot_window_s": 10.0})
    now = [100.0]
    policy.clock = lambda: now[0]
    policy.on_routed(req("r1", [1, 2, 3]), "a")
    assert policy.routed_prefixes([1, 2, 3, 4], PODS) == {"a": 3}
    now[0] = 111.0  # past the window: the pod may have evicted it
    assert policy.routed_prefixes([1, 2, 3, 4], PODS) == {}
