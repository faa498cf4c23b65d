"""What the router sees of its pods: scraped metrics, KV events, free cache blocks for a
new prefix, orphan blocks, a bad tokenizer at start, pods discovered later, sessions."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from router.config import Settings
from router.decision.views import RESIDENT_STALE_S
from router.fleet.embedded import start_pods, static_pods, stop_pods
from router.proxy.app import create_app
from router.proxy.serve import RunningServer
from tests.router.app_rig import MODEL, Rig, chat, running, sim


async def test_scraped_pod_metrics_feed_the_load_view_and_block_size(rig: Rig) -> None:
    scraped = rig.gateway.scraper.get("sim-0")
    assert scraped is not None
    assert scraped.block_size == 16
    assert scraped.capacity_blocks == sim(0).capacity_blocks
    assert scraped.running == 0 and scraped.waiting == 0


async def test_route_sees_the_blocks_a_pod_reported_through_kv_events() -> None:
    import asyncio

    async with running([sim(0, kv_events=True), sim(1, kv_events=True)], events=True) as r:
        body = chat("a long shared prefix " * 40)
        first = await r.client.post("/v1/chat/completions", json=body)
        pod = first.headers["x-kvroute-pod"]
        explained: dict[str, Any] = {}
        for _ in range(500):  # the pod's BlockStored events reach the index
            explained = (await r.client.post("/v1/route", json=body)).json()
            cand = {c["pod"]: c for c in explained["candidates"]}
            if cand[pod]["cached_blocks"].get("GPU", 0) > 0:
                break
            await asyncio.sleep(0.02)
        cand = {c["pod"]: c for c in explained["candidates"]}
        assert cand[pod]["cached_blocks"]["GPU"] == explained["blocks"]
        assert cand[pod]["cached_tokens"] == explained["blocks"] * 16
        other = "sim-1" if pod == "sim-0" else "sim-0"
        assert cand[other]["cached_blocks"] == {}
        assert explained["pod"] == pod  # the prefix holder wins
        m = await r.metrics()
        assert "kvroute_event_lag_seconds" in m
        # what each cache holds is in the views (counts re-read every RESIDENT_STALE_S):
        # a prefix nobody holds starts where there is the most room, i.e. not on the pod
        # that holds the first one
        await asyncio.sleep(2 * RESIDENT_STALE_S)
        explained = (await r.client.post("/v1/route", json=body)).json()
        cand = {c["pod"]: c for c in explained["candidates"]}
        assert cand[pod]["resident_blocks"] >= explained["blocks"]
        assert cand[other]["resident_blocks"] == 0
        cold_body = {"model": MODEL, "prompt": "a new topic " * 40, "max_tokens": 4}
        cold = await r.client.post("/v1/completions", json=cold_body)
        assert cold.headers["x-kvroute-pod"] == other


async def test_a_new_prefix_starts_on_the_pod_with_the_most_free_cache_blocks() -> None:
    """Caches of different sizes: the big pod already holds a prefix, the small one
    nothing, yet the big one has more free blocks, so a prefix nobody holds starts there
    (counting resident blocks alone would pick the small, empty pod)."""
    import asyncio

    small, big = sim(0, kv_events=True, capacity_tokens=2048), sim(1, kv_events=True)
    async with running([small, big], events=True) as r:
        warm = {"model": MODEL, "prompt": "what the big pod holds " * 40, "max_tokens": 1}
        async with httpx.AsyncClient(timeout=30) as direct:  # bypassing the router
            (await direct.post(f"{r.pods[1].url}/v1/completions", json=warm)).raise_for_status()
        cold = {"model": MODEL, "prompt": "a new topic " * 40, "max_tokens": 1}
        for _ in range(500):  # the big pod's events reach the index, its count the views
            cand = {
                c["pod"]: c
                for c in (await r.client.post("/v1/route", json=cold)).json()["candidates"]
            }
            if cand["sim-1"]["resident_blocks"] > 0:
                break
            await asyncio.sleep(0.02)
        assert cand["sim-0"]["resident_blocks"] == 0
        assert cand["sim-0"]["capacity_blocks"] == small.capacity_blocks == 128
        assert cand["sim-1"]["capacity_blocks"] == big.capacity_blocks
        assert big.capacity_blocks - cand["sim-1"]["resident_blocks"] > small.capacity_blocks
        sent = await r.client.post("/v1/completions", json=cold)
        assert sent.headers["x-kvroute-pod"] == "sim-1"


async def test_an_orphan_block_from_a_pod_raises_the_applier_orphan_counter_on_metrics() -> None:
    """A BlockStored whose parent the router never saw (a missed event) is held as an
    orphan by the applier, and `kvroute serve`'s /metrics shows it."""
    import asyncio

    from router.sim.events import BlockStored

    async with running([sim(0, kv_events=True)], events=True) as r:
        name = "kvroute_event_applier_orphaned_blocks_total"

        def orphans(m: str) -> float:
            line = next(ln for ln in m.splitlines() if ln.startswith(name + " "))
            return float(line.split()[1])

        before = orphans(await r.metrics())
        assert r.pods[0].publisher is not None
        orphan = BlockStored(
            block_hashes=[0xDEAD],
            parent_block_hash=0xBEEF,  # never stored: the parent event was "lost"
            token_ids=list(range(16)),
            block_size=16,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        )
        after = before
        for _ in range(300):  # the subscriber joins, then the batch reaches the applier
            r.pods[0].publisher.publish([orphan])
            await asyncio.sleep(0.02)
            after = orphans(await r.metrics())
            if after > before:
                break
        assert after > before
        assert "kvroute_event_applier_batches_total" in await r.metrics()


async def test_a_bad_tokenizer_spec_fails_the_start_instead_of_the_first_request() -> None:
    pods = await start_pods([sim(0)])
    try:
        settings = Settings.model_validate(
            {
                "discovery": {"static": [p.model_dump() for p in static_pods(pods)]},
                "events": {"enabled": False},
                "fleet": {"enabled": False},
                "tokenizers": {MODEL: "/nonexistent/model-dir"},
            }
        )
        with pytest.raises(RuntimeError, match="startup"):
            await RunningServer(create_app(settings)).start()
    finally:
        await stop_pods(pods)


async def test_a_pod_discovered_later_is_health_checked_and_served_at_once(rig: Rig) -> None:
    import asyncio

    from router.fleet.pods import PodSpec

    late = (await start_pods([sim(7, lora_adapters=["late-lora"])]))[0]
    try:
        registry = rig.gateway.registry
        # a discovery source adds a pod whose models are only known from /v1/models
        registry.set_pods([*(p.spec for p in registry.all()), PodSpec("sim-7", late.url)])
        for _ in range(500):
            state = registry.get("sim-7")
            if state is not None and "late-lora" in state.models:
                break
            await asyncio.sleep(0.02)
        r = await rig.client.post("/v1/chat/completions", json={**chat(), "model": "late-lora"})
        assert r.status_code == 200 and r.headers["x-kvroute-pod"] == "sim-7"
    finally:
        await stop_pods([late])


async def test_session_id_from_the_header_or_the_body_user_field_reaches_the_policy() -> None:
    async with running([sim(i) for i in range(4)], policy="session") as r:

        async def pods_for(headers: dict[str, str], extra: dict[str, Any]) -> set[str]:
            seen = set()
            for i in range(6):  # different prompts, same session
                resp = await r.client.post(
                    "/v1/chat/completions", json=chat(f"turn {i}", **extra), headers=headers
                )
                assert resp.status_code == 200
                seen.add(resp.headers["x-kvroute-pod"])
            return seen

        alice = await pods_for({"x-session-id": "alice"}, {})
        assert len(alice) == 1
        assert len(await pods_for({}, {"user": "bob"})) == 1
        explained = await r.client.post(
            "/v1/route", json=chat("x"), headers={"x-session-id": "alice"}
        )
        assert explained.json()["policy"] == "session"
        assert {explained.json()["pod"]} == alice
