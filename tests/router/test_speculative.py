"""Speculative index entries, live: simulated vLLM pods (real HTTP, real ZMQ KV events,
their own prefix caches and hit counters) behind the router on 127.0.0.1.

A pod the KV events cannot describe -- it publishes none, or the index lost its entries
-- is learned from the requests routed to it (router/decision/learning.py); the pods'
own ``vllm:prefix_cache_hits_total`` show whether that placement hit their caches.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from router.config import Settings
from router.fleet.embedded import start_pods, static_pods, stop_pods
from router.proxy.app import create_app
from router.proxy.gateway import Gateway
from router.proxy.serve import RunningServer
from router.sim.pod import SimPod
from router.sim.settings import SimSettings
from tests.support.aio import wait_until

MODEL = "sim-model"
BLOCK = 16
#: ~60 blocks of the builtin byte tokenizer: a prompt worth keeping on one pod
HOT = "You are the support assistant of a large bank; answer in two sentences. " * 14
REPEATS = 8


def sims(n: int, **kw: Any) -> list[SimSettings]:
    return [
        SimSettings(pod_name=f"sim-{i}", model=MODEL, block_size=BLOCK, time_scale=0.0, **kw)
        for i in range(n)
    ]


@contextlib.asynccontextmanager
async def routed(
    pods: list[SimPod], **settings: Any
) -> AsyncIterator[tuple[Gateway, httpx.AsyncClient]]:
    """The router (``cost`` policy) in front of ``pods``; ``settings`` override."""
    config = Settings.model_validate(
        {
            "discovery": {"static": [p.model_dump() for p in static_pods(pods)]},
            "fleet": {"enabled": False},
            "scrape": {"interval_s": 0.1},
            **settings,
        }
    )
    app = create_app(config)
    async with RunningServer(app) as server:
        gateway: Gateway = app.state.gateway
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            yield gateway, client


@contextlib.asynccontextmanager
async def fleet(settings: list[SimSettings]) -> AsyncIterator[list[SimPod]]:
    pods = await start_pods(settings)
    try:
        yield pods
    finally:
        await stop_pods(pods)


async def send(client: httpx.AsyncClient, prompt: str = HOT) -> str:
    r = await client.post(
        "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}
    )
    assert r.status_code == 200, r.text
    return r.headers["x-kvroute-pod"]


async def explain(client: httpx.AsyncClient, prompt: str = HOT) -> dict[str, dict[str, Any]]:
    r = await client.post("/v1/route", json={"model": MODEL, "prompt": prompt})
    assert r.status_code == 200, r.text
    return {c["pod"]: c for c in r.json()["candidates"]}


async def pod_hits(pod: SimPod) -> float:
    """The pod's own vllm:prefix_cache_hits_total (tokens)."""
    async with httpx.AsyncClient() as c:
        text = (await c.get(pod.url + "/metrics")).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:prefix_cache_hits_total")
    )


async def metric(client: httpx.AsyncClient, prefix: str) -> float:
    """Sum of the router's samples whose line starts with ``prefix``."""
    text = (await client.get("/metrics")).text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(prefix))


def by_name(pods: list[SimPod], name: str) -> SimPod:
    return next(p for p in pods if p.name == name)


# -- pods whose events never reach the index (#15) ------------------------------------


@pytest.mark.parametrize(
    ("pod_events", "router_events"),
    [(False, False), (False, True)],
    ids=["router-events-off", "pods-publish-none"],
)
async def test_without_kv_events_a_repeated_prompt_stays_on_one_pod_and_hits_its_cache(
    pod_events: bool, router_events: bool
) -> None:
    async with (
        fleet(sims(4, kv_events=pod_events)) as pods,
        routed(pods, events={"enabled": router_events}) as (gateway, client),
    ):
        chosen = [await send(client) for _ in range(REPEATS)]
        assert len(set(chosen)) == 1, chosen
        pod = by_name(pods, chosen[0])
        # every repeat hit the pod's cache for (nearly) the whole prompt
        prompt_tokens = len(HOT.encode())
        assert await pod_hits(pod) >= (REPEATS - 1) * (prompt_tokens - 2 * BLOCK)
        for other in pods:
            if other is not pod:
                assert await pod_hits(other) == 0
        reason = "events_off" if not router_events else "never_published"
        assert gateway.learner.reason(pod.name) == reason
        assert await metric(client, f'kvroute_speculative_hits_total{{pod="{pod.name}"}}') == (
            REPEATS - 1
        )


async def test_without_speculative_entries_the_same_prompt_spreads_and_misses() -> None:
    """The control: with ``speculative.enabled: false`` and no events, nothing tells the
    router where the prompt went (what the wrk benchmark showed)."""
    async with (
        fleet(sims(4, kv_events=False)) as pods,
        routed(pods, events={"enabled": False}, speculative={"enabled": False}) as (_, client),
    ):
        chosen = [await send(client) for _ in range(REPEATS)]
        # ties broken by a hash of the request id: 8 picks over 4 pods, one pod for all
        # with probability 4 / 4**8
        assert len(set(chosen)) > 1, chosen
        assert (await explain(client))[chosen[0]]["cached_blocks"] == {}


async def test_speculative_entries_expire_after_their_ttl() -> None:
    async with (
        fleet(sims(2, kv_events=False)) as pods,
        routed(pods, events={"enabled": False}, speculative={"ttl_s": 0.3}) as (g, client),
    ):
        pod = await send(client)
        assert (await explain(client))[pod]["speculative_blocks"] > 0

        async def expired() -> bool:
            return (await explain(client))[pod]["speculative_blocks"] == 0

        await wait_until(expired, "the entries to expire")
        assert g.learner.index.stats.expired > 0
        assert await metric(client, "kvroute_speculative_expired_total") > 0


async def test_the_speculative_index_stays_within_max_entries() -> None:
    async with (
        fleet(sims(2, kv_events=False)) as pods,
        routed(pods, events={"enabled": False}, speculative={"max_entries": 40}) as (g, client),
    ):
        for i in range(6):  # 6 distinct ~60-block prompts
            await send(client, f"conversation {i}: " + HOT)
        assert len(g.learner.index) <= 40
        assert g.learner.index.stats.evicted > 0
        assert await metric(client, "kvroute_speculative_entries{") <= 40
        assert await metric(client, "kvroute_speculative_evicted_total") > 0


async def test_a_pod_that_lost_the_prompt_is_dropped_by_its_own_hit_counter() -> None:
    """No events: the pod's cache is reset behind the router's back.  The next request
    credited speculatively to it hits nothing, and the probe drops the entries."""
    async with (
        fleet(sims(2, kv_events=False)) as pods,
        routed(pods, events={"enabled": False}) as (g, client),
    ):
        first = await send(client)
        assert await send(client) == first

        async def judged() -> bool:  # the first repeat's probe: the pod did hit
            return g.learner.probes["kept"] >= 1

        await wait_until(judged, "the repeat's probe to be kept")
        by_name(pods, first).reset_prefix_cache()
        assert await send(client) == first  # still credited: nothing said otherwise

        async def dropped() -> bool:
            return (await explain(client))[first]["speculative_blocks"] == 0

        await wait_until(dropped, "the unhit speculative entries to be dropped")
        assert g.learner.probes["dropped"] == 1
        assert await metric(client, 'kvroute_speculative_dropped_total{reason="no_hits"}') > 0


# -- pods whose index entries were lost (#10) -----------------------------------------


async def settled(g: Gateway, pods: list[SimPod]) -> None:
    """Every batch the pods published has been applied."""
    sub = g.subscriber
    assert sub is not None

    def received() -> bool:
        return all(
            p.publisher is None
            or p.publisher.next_seq == 0
            or (
                p.name in sub.stats.pods
                and sub.stats.pods[p.name].last_seq >= p.publisher.next_seq - 1
            )
            for p in pods
        )

    await wait_until(received, "the pods' KV events to be applied")
    await sub.drain()


async def test_a_resynced_pod_keeps_its_hot_prefix_and_keeps_getting_it() -> None:
    async with fleet(sims(4)) as pods, routed(pods) as (g, client):
        hot = await send(client)
        await settled(g, pods)
        cand = (await explain(client))[hot]
        assert cand["cached_blocks"]["GPU"] > 0 and cand["speculative_blocks"] == 0
        blocks = cand["cached_blocks"]["GPU"]
        before = await pod_hits(by_name(pods, hot))

        # what the subscriber does on a gap its replay cannot fill: forget the pod
        assert g.sink is not None
        await g.sink.clear_pod(hot)
        assert (await g.index.pod_entries()).get(hot, 0) == 0
        cand = (await explain(client))[hot]
        assert cand["speculative_blocks"] == blocks  # carried over, not forgotten
        assert g.learner.reason(hot) == "cleared"

        chosen = [await send(client) for _ in range(REPEATS)]
        assert chosen == [hot] * REPEATS
        gained = await pod_hits(by_name(pods, hot)) - before
        assert gained >= REPEATS * (blocks - 1) * BLOCK


async def test_after_a_resync_without_speculative_entries_the_pod_goes_dark() -> None:
    """The control of the test above: the index alone forgets the hot prefix."""
    async with fleet(sims(4)) as pods, routed(pods, speculative={"enabled": False}) as (g, c):
        hot = await send(c)
        await settled(g, pods)
        assert g.sink is not None
        await g.sink.clear_pod(hot)
        assert (await explain(c))[hot]["cached_blocks"] == {}


async def test_a_blockstored_confirms_a_speculative_entry() -> None:
    """A pod that has not published yet learns from the first request; its BlockStored
    then moves the blocks into the index and the speculative entries go."""
    async with fleet(sims(2)) as pods, routed(pods) as (g, client):
        pod = await send(client)
        await settled(g, pods)

        async def confirmed() -> bool:
            return g.learner.index.stats.confirmed > 0 and not g.learner.index.holds(pod)

        await wait_until(confirmed, "the BlockStored to confirm the entries")
        cand = (await explain(client))[pod]
        assert cand["cached_blocks"]["GPU"] > 0 and cand["speculative_blocks"] == 0
        assert g.learner.reason(pod) is None  # it publishes: no more learning
        assert await metric(client, "kvroute_speculative_confirmed_total") > 0


async def test_a_blockremoved_drops_a_carried_entry() -> None:
    """After a resync the applier no longer knows the pod's blocks; their BlockRemoved
    still drops the carried entries (matched by engine hash)."""
    small = sims(2, capacity_tokens=100 * BLOCK)
    async with fleet(small) as pods, routed(pods) as (g, client):
        hot = await send(client)
        await settled(g, pods)
        assert g.sink is not None
        await g.sink.clear_pod(hot)
        assert (await explain(client))[hot]["speculative_blocks"] > 0
        # other prompts straight to the pod evict the hot one (tail first)
        async with httpx.AsyncClient(base_url=by_name(pods, hot).url) as direct:
            for i in range(4):
                body = {"model": MODEL, "prompt": f"{i} other " * 120, "max_tokens": 1}
                assert (await direct.post("/v1/completions", json=body)).status_code == 200
        await settled(g, pods)
        assert g.learner.dropped["removed"] > 0
        assert (await explain(client))[hot]["cached_blocks"] == {}


async def test_allblockscleared_drops_every_speculative_entry_of_the_pod() -> None:
    async with fleet(sims(2)) as pods, routed(pods) as (g, client):
        hot = await send(client)
        await settled(g, pods)
        assert g.sink is not None
        await g.sink.clear_pod(hot)
        assert g.learner.index.holds(hot)
        pod = by_name(pods, hot)
        pod.reset_prefix_cache()  # AllBlocksCleared, published at the next engine step
        async with httpx.AsyncClient(base_url=pod.url) as direct:
            body = {"model": MODEL, "prompt": "something else", "max_tokens": 1}
            assert (await direct.post("/v1/completions", json=body)).status_code == 200
        await settled(g, pods)
        assert not g.learner.index.holds(hot)
        assert g.learner.dropped["all_cleared"] > 0
        assert g.learner.reason(hot) is None  # the index is exact again


# -- a replica reading a shared index (Redis) -----------------------------------------


async def test_a_replica_notices_the_shared_index_losing_a_pod_and_learns_it(
    redis_url: str, redis_namespace: str
) -> None:
    import valkey.asyncio as valkey

    from router.indexer.main import Indexer

    shared = {"redis_url": redis_url, "redis_namespace": redis_namespace}
    async with fleet(sims(2)) as pods:
        settings = Settings.model_validate(
            {
                "discovery": {"static": [p.model_dump() for p in static_pods(pods)]},
                "fleet": {"enabled": False},
                **shared,
            }
        )
        indexer = Indexer(settings, redis_url, metrics_port=0)
        await indexer.start()
        try:
            async with routed(pods, **shared) as (g, client):
                assert g.subscriber is None
                hot = await send(client)

                async def indexed() -> bool:
                    return g.learner.reason(hot) is None  # its entries reached Redis

                await wait_until(indexed, "the replica to see the pod's entries")
                # data loss: every key of the namespace goes (a FLUSHALL, for us)
                r = valkey.Valkey.from_url(redis_url)
                try:
                    keys = [k async for k in r.scan_iter(match=f"*{{{redis_namespace}}}*")]
                    assert keys
                    await r.delete(*keys)
                finally:
                    await r.aclose()

                async def noticed() -> bool:
                    return g.learner.reason(hot) == "cleared"

                await wait_until(noticed, "the replica to notice the lost entries")
                chosen = [await send(client) for _ in range(REPEATS)]
                assert len(set(chosen[1:])) == 1, chosen
        finally:
            await indexer.stop()
