"""Engine-hash mode wired into ``kvroute serve`` (``events.engine_hash_*``): settings,
the bounded learn queue, and orphan recovery in the live router against a simulated
pod that hashes its blocks like vLLM (``hash_algo="sha256"``)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from router.config import Settings
from router.events import EventsSettings, IndexSink
from router.events.sink import build_engine_hasher
from router.fleet.embedded import start_pods, static_pods, stop_pods
from router.proxy.app import create_app
from router.proxy.gateway import Gateway
from router.proxy.serve import RunningServer
from router.sim.settings import SimSettings
from scoring.events import IndexOps
from scoring.events.engine_hash import DEFAULT_SEED
from scoring.index.memory import InMemoryIndex
from tests.support.aio import wait_until

MODEL = "sim-model"


# -- settings ----------------------------------------------------------------------------


def test_engine_hash_mode_is_off_by_default() -> None:
    s = EventsSettings()
    assert s.engine_hash_algo is None and s.engine_hash_seed is None and s.engine_hash_int
    assert build_engine_hasher(s) is None


def test_xxhash_without_a_seed_is_refused_naming_the_setting() -> None:
    for algo in ("xxhash", "xxhash_cbor"):
        with pytest.raises(ValidationError, match=r"events\.engine_hash_seed"):
            EventsSettings(engine_hash_algo=algo)
        with pytest.raises(ValidationError, match="engine_hash_seed"):
            Settings.model_validate({"events": {"engine_hash_algo": algo}})
    h = build_engine_hasher(EventsSettings(engine_hash_algo="xxhash", engine_hash_seed="42"))
    assert h is not None and h.algo == "xxhash" and h.seed == "42"


def test_unknown_algorithms_and_fields_are_refused() -> None:
    with pytest.raises(ValidationError):
        EventsSettings(engine_hash_algo="md5")
    with pytest.raises(ValidationError):
        EventsSettings.model_validate({"engine_hash_sead": "1"})


def test_sha256_defaults_to_vllms_seed_not_the_routers_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    h = build_engine_hasher(EventsSettings(engine_hash_algo="sha256", engine_hash_int=False))
    assert h is not None and h.seed == DEFAULT_SEED and h.int_hashes is False


def test_lora_adapter_paths_are_a_setting_the_hasher_gets() -> None:
    paths = {"ad1": "/adapters/ad1"}
    s = Settings.model_validate(
        {"events": {"engine_hash_algo": "sha256", "engine_hash_lora_paths": paths}}
    )
    h = build_engine_hasher(s.events)
    assert h is not None and h.lora_paths == paths


# -- the learn queue ---------------------------------------------------------------------


async def test_the_learn_queue_is_bounded_and_drops_are_counted() -> None:
    sink = IndexSink(
        InMemoryIndex(),
        learn_queue=1,
        block_size=16,
        engine_hasher=build_engine_hasher(EventsSettings(engine_hash_algo="sha256")),
    )
    sink.learn_later(MODEL, list(range(32)), 16, [1, 2])  # not started: ignored
    assert sink.learn_dropped == 0
    sink.start_learning()
    try:
        sink.learn_later(MODEL, list(range(32)), 16, [1, 2])
        sink.learn_later(MODEL, list(range(32, 64)), 16, [3, 4])  # queue full
        assert sink.learn_dropped == 1
        await wait_until(lambda: sink.learn_requests == 1, "the queued chain learned")
        assert sink.applier.hasher is not None and sink.applier.hasher.learned_blocks == 2
        assert sink.extra_stats()["engine_hash_learn_dropped"] == 1
        assert sink.gauges()["engine_hash_enabled"] == 1.0
    finally:
        await sink.stop_learning()


async def test_a_lora_chain_is_learned_once_its_adapter_path_is_known() -> None:
    """vLLM hashes ("lora", name, path) into every block: without the path nothing can
    be learned (counted); the pods' reported path is taken, a configured one wins."""
    hasher = build_engine_hasher(
        EventsSettings(engine_hash_algo="sha256", engine_hash_lora_paths={"ad2": "/cfg/ad2"})
    )
    sink = IndexSink(InMemoryIndex(), block_size=16, engine_hasher=hasher)
    assert hasher is not None
    reported = {"ad2": "/pod/ad2"}
    sink.start_learning()
    try:
        sink.learn_later(MODEL, list(range(32)), 16, [1, 2], lora="ad1")
        await wait_until(lambda: sink.learn_lora_unknown == 1, "the unknown adapter counted")
        assert sink.learn_requests == 0 and hasher.learned_blocks == 0
        assert sink.extra_stats()["engine_hash_lora_unknown"] == 1

        reported["ad1"] = "/pod/ad1"
        sink.lora_path_of = reported.get
        sink.learn_later(MODEL, list(range(32)), 16, [1, 2], lora="ad1")
        sink.learn_later(MODEL, list(range(32)), 16, [3, 4], lora="ad2")
        await wait_until(lambda: sink.learn_requests == 2, "both adapters learned")
        assert hasher.learned_blocks == 4 and sink.learn_lora_unknown == 1
        assert hasher.lora_paths == {"ad1": "/pod/ad1", "ad2": "/cfg/ad2"}
    finally:
        await sink.stop_learning()


class _GatedIndex(InMemoryIndex):
    """An in-memory index whose first add waits for :attr:`gate` (a slow Redis write)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()

    async def add(self, pod: str, keys: Sequence[int], tier: str = "GPU") -> None:
        if not self.entered.is_set():
            self.entered.set()
            await self.gate.wait()
        await super().add(pod, keys, tier)


async def test_index_writes_land_in_the_order_the_applier_computed_them() -> None:
    """Events and learned links are two writers: a removal computed after a link must
    not land before it, even when the link's write is slow."""
    index = _GatedIndex()
    sink = IndexSink(
        index,
        block_size=16,
        engine_hasher=build_engine_hasher(EventsSettings(engine_hash_algo="sha256")),
    )
    link, removal = IndexOps(), IndexOps()
    link.add("sim-0", "GPU", [7])
    removal.remove("sim-0", "GPU", [7])
    first = asyncio.create_task(sink._run(link))
    await asyncio.wait_for(index.entered.wait(), 10)
    second = asyncio.create_task(sink._run(removal))
    await asyncio.sleep(0.05)
    assert not second.done()  # queued behind the slow link
    index.gate.set()
    await asyncio.wait_for(asyncio.gather(first, second), 10)
    assert await index.lookup([7], ["sim-0"]) == {}


async def test_without_engine_hash_mode_the_sink_learns_nothing() -> None:
    sink = IndexSink(InMemoryIndex(), block_size=16)
    sink.start_learning()
    sink.learn_later(MODEL, list(range(32)), 16, [1, 2])
    assert sink.extra_stats() == {} and sink.gauges() == {}
    await sink.stop_learning()


# -- the live router ---------------------------------------------------------------------


def _metric(text: str, name: str) -> float:
    for ln in text.splitlines():
        if ln.startswith(name + " "):
            return float(ln.split()[1])
    return 0.0


@pytest.mark.parametrize("model", [MODEL, "ad1"], ids=["base-model", "lora-adapter"])
async def test_a_late_joining_router_links_an_orphan_after_routing_its_prefix(model: str) -> None:
    """The pod cached a prefix before the router joined (no replay), so the blocks it
    stores next are orphans; routing a request with that prefix lets the router
    reproduce the engine's hashes, link the orphans, and route on the whole chain.
    For a LoRA adapter the hash needs the adapter's path, which the router takes from
    the pod's /v1/models (``root``) without configuration."""
    pods = await start_pods(
        [
            SimSettings.model_validate(
                {
                    "pod_name": "sim-0",
                    "time_scale": 0,
                    "kv_events": True,
                    "replay_endpoint": None,
                    "hash_algo": "sha256",
                    "max_model_len": 4096,
                    "lora_adapters": ["ad1"],
                }
            )
        ]
    )
    pod = pods[0]
    prefix = [1000 + i for i in range(64)]  # 4 blocks of 16
    router: RunningServer | None = None
    try:
        async with httpx.AsyncClient(timeout=30) as direct:

            async def complete(ids: list[int]) -> None:
                r = await direct.post(
                    f"{pod.url}/v1/completions",
                    json={"model": model, "prompt": ids, "max_tokens": 1},
                )
                r.raise_for_status()

            await complete(prefix)  # nobody listens yet: these events are missed
            settings = Settings.model_validate(
                {
                    "discovery": {"static": [p.model_dump() for p in static_pods(pods)]},
                    "events": {
                        "enabled": True,
                        "replay_on_join": False,
                        "replay_on_gap": False,
                        "engine_hash_algo": "sha256",
                    },
                    "fleet": {"enabled": False},
                    "block_size": 16,
                }
            )
            router = await RunningServer(create_app(settings)).start()
            app: Any = router.server.config.app
            gw: Gateway = app.state.gateway
            assert gw.sink is not None and gw.sink.applier.hasher is not None
            async with httpx.AsyncClient(base_url=router.url, timeout=30) as client:
                # the pod extends the prefix: stored blocks whose parent we never saw
                ext: list[int] = []
                loop = asyncio.get_running_loop()
                deadline = loop.time() + 20
                for i in range(1000):
                    ext = [2000 + 32 * i + j for j in range(32)]  # 2 new blocks
                    await complete(prefix + ext)
                    await asyncio.sleep(0.02)
                    m = (await client.get("/metrics")).text
                    if _metric(m, "kvroute_event_applier_orphaned_blocks_total") > 0:
                        break
                    assert loop.time() < deadline, "no orphan arrived"
                m = (await client.get("/metrics")).text
                assert _metric(m, "kvroute_event_applier_orphans_linked_total") == 0
                assert _metric(m, "kvroute_event_engine_hash_enabled") == 1.0
                body = {"model": model, "prompt": prefix + ext, "max_tokens": 1}
                before = (await client.post("/v1/route", json=body)).json()
                assert before["blocks"] == 6
                assert before["candidates"][0]["cached_blocks"] == {}

                # a routed request with that prefix: learned off the request path
                r = await client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text

                async def linked() -> bool:
                    m = (await client.get("/metrics")).text
                    return _metric(m, "kvroute_event_applier_orphans_linked_total") >= 2

                await wait_until(linked, "the orphan linked")
                m = (await client.get("/metrics")).text
                assert _metric(m, "kvroute_event_applier_engine_hash_linked_total") >= 4
                assert _metric(m, "kvroute_event_applier_engine_hash_learned_requests_total") >= 1
                assert _metric(m, "kvroute_event_applier_engine_hash_mismatches_total") == 0
                assert _metric(m, "kvroute_event_engine_hash_learned_blocks") >= 6
                assert _metric(m, "kvroute_event_engine_hash_enabled") == 1.0
                assert _metric(m, "kvroute_event_applier_engine_hash_lora_unknown_total") == 0
                assert _metric(m, "kvroute_event_applier_engine_hash_matches_total") > 0
                after = (await client.post("/v1/route", json=body)).json()
                cand = {c["pod"]: c for c in after["candidates"]}
                assert cand["sim-0"]["cached_blocks"]["GPU"] == 6  # the whole chain
    finally:
        if router is not None:
            await router.stop()
        await stop_pods(pods)
