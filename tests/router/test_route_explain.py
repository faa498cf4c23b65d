"""``POST /v1/route``'s per-tier cached blocks: cumulative (a tier counts the blocks
servable from it or a faster one), and a slower tier is shown only where it adds blocks,
so a GPU-only engine does not read as if it had offload tiers (docs/route.md)."""

from __future__ import annotations

from router.decision.explain import shown_tiers
from tests.router.app_rig import chat, running, sim
from tests.support.aio import wait_until


def test_tiers_that_add_nothing_to_the_faster_ones_are_not_shown() -> None:
    assert shown_tiers({"GPU": 25, "CPU": 25, "DISK": 25}) == {"GPU": 25}
    assert shown_tiers({"GPU": 10, "CPU": 25, "DISK": 25}) == {"GPU": 10, "CPU": 25}
    assert shown_tiers({"GPU": 10, "CPU": 10, "DISK": 40}) == {"GPU": 10, "DISK": 40}


def test_gpu_is_always_shown_and_an_empty_view_stays_empty() -> None:
    assert shown_tiers({"CPU": 8, "DISK": 8}) == {"GPU": 0, "CPU": 8}
    assert shown_tiers({}) == {}


async def test_a_gpu_only_pod_shows_its_gpu_blocks_alone() -> None:
    async with running([sim(0, kv_events=True)], events=True) as rig:
        body = chat("a long shared prefix " * 40)
        await rig.client.post("/v1/chat/completions", json=body)

        async def indexed() -> bool:
            r = await rig.client.post("/v1/route", json=body)
            return bool(r.json()["candidates"][0]["cached_blocks"])

        await wait_until(indexed, "the prompt's blocks to reach the index")
        explained = (await rig.client.post("/v1/route", json=body)).json()
        assert explained["candidates"][0]["cached_blocks"] == {"GPU": explained["blocks"]}


async def test_an_offloaded_tail_shows_as_the_cpu_tiers_extra_blocks() -> None:
    async with running([sim(0)]) as rig:
        g = rig.gateway
        body = chat("a long shared prefix " * 40)
        routed = await g.router.decide("chat", body, {})
        keys = routed.route.block_keys
        assert len(keys) > 4
        await g.index.add("sim-0", keys[:2], tier="GPU")
        await g.index.add("sim-0", keys, tier="CPU")  # the whole chain offloaded
        explained = (await rig.client.post("/v1/route", json=body)).json()
        (cand,) = explained["candidates"]
        assert cand["cached_blocks"] == {"GPU": 2, "CPU": len(keys)}
        assert cand["cached_tokens"] == len(keys) * explained["block_size"]
