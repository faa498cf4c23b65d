"""Isolated KV-event ingestion (issue #10), events that contradict the pod: more blocks
than its cache holds, another block size; facts from a simulated pod's real ``/metrics``
(``router.sim``).
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import zmq
import zmq.asyncio
from prometheus_client import generate_latest

from router.events import EventsSettings
from router.fleet.pods import PodSpec
from router.fleet.scrape import MetricsScraper
from router.sim.events import EventFactory
from router.sim.pod import SimPod
from router.sim.settings import SimSettings
from tests.faults.events_isolation_support import ctx as ctx  # the fixture
from tests.support.aio import wait_until
from tests.support.kv_events import (
    BS,
    MODEL,
    Harness,
    chain,
    dial_pod,
    stored,
)


@dataclass
class Facts:
    capacity_blocks: int | None
    block_size: int | None


async def test_batches_beyond_the_pods_cache_or_of_another_block_size_are_rejected(
    ctx: zmq.asyncio.Context,
) -> None:
    facts = Facts(capacity_blocks=8, block_size=BS)
    async with dial_pod(ctx) as (h, pub):
        h.sub.pod_facts = lambda pod: facts
        await pub.send([stored(chain(5), [1, 2, 3, 4, 5])])
        await h.applied(1)
        assert await h.blocks_held(chain(5)) == 5
        # 5 + 4 = 9 blocks held > 8: the stream contradicts the cache's size
        await pub.send([stored(chain(4, start=BS * 100), [11, 12, 13, 14])])
        await wait_until(lambda: h.sub.stats.pod("p").rejected["capacity"] == 1)
        await h.sub.drain()
        assert await h.blocks_held(chain(5)) == 0  # resynced
        assert await h.blocks_held(chain(4, start=BS * 100)) == 0
        wrong = stored(chain(1, start=BS * 200), [21])
        wrong["block_size"] = 2 * BS
        wrong["token_ids"] = chain(2, start=BS * 200)
        await pub.send([wrong])
        await wait_until(lambda: h.sub.stats.pod("p").rejected["block_size"] == 1)
        await pub.send([stored(chain(3, start=BS * 300), [31, 32, 33])])
        await h.applied(2)
        st = h.sub.stats.pod("p")
        assert st.resyncs["rejected"] == 2 and st.gaps == 0
        assert await h.blocks_held(chain(3, start=BS * 300)) == 3
        text = generate_latest(h.metrics).decode()
        assert 'kvroute_event_rejected_total{pod="p",reason="capacity"} 1.0' in text
        assert 'kvroute_event_resyncs_total{pod="p",reason="rejected"} 2.0' in text


async def test_a_sim_pod_whose_stream_claims_more_blocks_than_its_cache_is_rejected(
    ctx: zmq.asyncio.Context,
) -> None:
    """Facts from the pod's real /metrics; a cache filled by real traffic (evictions and
    all) is never rejected; one forged message claiming 40 blocks on a 16-block cache
    is."""
    pod = SimPod(
        SimSettings(
            model=MODEL, pod_name="sim-0", block_size=BS, capacity_tokens=16 * BS, time_scale=0.0
        )
    )
    await pod.start()
    h = Harness(ctx, EventsSettings(mode="dial"))
    client = httpx.AsyncClient(timeout=10)
    scraper = MetricsScraper(h.registry, client, interval_s=60, timeout_s=5, stale_after_s=60)
    h.sub.pod_facts = scraper.cache_config
    await h.sub.start()
    h.registry.set_pods(
        [
            PodSpec(
                name=pod.name,
                url=pod.url,
                events_endpoint=pod.events_endpoint,
                replay_endpoint=pod.replay_endpoint_url,
                models=(MODEL,),
            )
        ]
    )
    try:
        await scraper.scrape_all()
        facts = scraper.cache_config(pod.name)
        assert facts is not None and (facts.capacity_blocks, facts.block_size) == (16, BS)
        for i in range(12):  # 12 prompts x 3 blocks through a 16-block cache
            r = await client.post(
                f"{pod.url}/v1/completions",
                json={"model": MODEL, "prompt": f"prompt {i:02d} " * 6, "max_tokens": 1},
            )
            r.raise_for_status()
        await wait_until(lambda: h.sub.stats.pod(pod.name).batches >= 12)
        await h.sub.drain()
        st = h.sub.stats.pod(pod.name)
        assert not st.rejected and st.total_resyncs == 0
        held = h.sink.applier.pod(pod.name)
        assert held is not None and 0 < held.gpu_blocks <= 16
        forged = EventFactory("map").stored(
            list(range(1, 41)),
            None,
            list(range(40 * BS)),
            BS,
            lora_id=None,
            lora_name=None,
            extra_keys=[],
        )
        assert pod.publisher is not None
        pod.publisher.publish([forged])
        await wait_until(lambda: st.rejected["capacity"] == 1)
        await h.sub.drain()
        assert await h.blocks_held(list(range(40 * BS)), pod.name) == 0
    finally:
        await h.sub.stop()
        await client.aclose()
        await pod.stop()
