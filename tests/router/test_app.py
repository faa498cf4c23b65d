"""The router's API in front of real simulated vLLM pods: validation errors, /v1/models,
/ready, /health, /metrics, /v1/route, model and LoRA filtering, completions forms."""

from __future__ import annotations

import contextlib
import importlib.metadata
import math
import platform
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from router.config import Settings
from router.decision.views import RESIDENT_STALE_S
from router.fleet.embedded import start_pods, static_pods, stop_pods
from router.proxy.app import create_app
from router.proxy.gateway import Gateway
from router.proxy.serve import RunningServer
from router.sim.pod import SimPod
from router.sim.settings import SimSettings

MODEL = "sim-model"


@dataclass
class Rig:
    pods: list[SimPod]
    router: RunningServer
    client: httpx.AsyncClient

    @property
    def gateway(self) -> Gateway:
        app: Any = self.router.server.config.app
        g: Gateway = app.state.gateway
        return g

    async def metrics(self) -> str:
        return (await self.client.get("/metrics")).text


@contextlib.asynccontextmanager
async def running(
    sims: list[SimSettings],
    events: bool = False,
    other_pods: tuple[dict[str, Any], ...] = (),
    **overrides: Any,
) -> AsyncIterator[Rig]:
    """Sim pods (and ``other_pods``, static entries of pods the test runs) and a router
    in front of them (static discovery), stopped on exit."""
    pods = await start_pods(sims)
    try:
        static = [*(p.model_dump() for p in static_pods(pods)), *other_pods]
        settings = Settings.model_validate(
            {
                "discovery": {"static": static},
                "events": {"enabled": events},
                "fleet": {"enabled": False},
                **overrides,
            }
        )
        router = await RunningServer(create_app(settings)).start()
        rig = Rig(pods, router, httpx.AsyncClient(base_url=router.url, timeout=30))
        try:
            yield rig
        finally:
            await rig.client.aclose()
            await router.stop()
    finally:
        await stop_pods(pods)


def sim(i: int, **kw: Any) -> SimSettings:
    return SimSettings.model_validate(
        {"pod_name": f"sim-{i}", "time_scale": 0, "kv_events": False, "max_model_len": 4096, **kw}
    )


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    async with running([sim(0), sim(1, lora_adapters=["sql-lora"])]) as r:
        yield r


def chat(content: str = "hello", **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}


async def assert_openai_error(r: httpx.Response, status: int, code: str) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err: dict[str, Any] = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code
    assert err["message"]
    return err


# -- answers ---------------------------------------------------------------------------


async def test_chat_completion_is_answered_by_a_pod_named_in_the_header(rig: Rig) -> None:
    r = await rig.client.post("/v1/chat/completions", json=chat())
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "chat.completion"
    assert r.headers["x-kvroute-pod"] in {"sim-0", "sim-1"}


async def test_streaming_chat_is_relayed_as_sse(rig: Rig) -> None:
    async with rig.client.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as r:
        assert r.status_code == 200
        body = b"".join([c async for c in r.aiter_raw()])
    assert body.startswith(b"data: ") and body.rstrip().endswith(b"data: [DONE]")


@pytest.mark.parametrize(
    "prompt", ["once upon a time", ["a one-element batch"], [1, 2, 3, 4], [[5, 6, 7]]]
)
async def test_completions_accept_every_prompt_form(rig: Rig, prompt: Any) -> None:
    r = await rig.client.post(
        "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4}
    )
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "text_completion"


async def test_lora_adapter_requests_go_only_to_pods_serving_it(rig: Rig) -> None:
    for i in range(6):
        r = await rig.client.post(
            "/v1/chat/completions", json={**chat(f"q{i}"), "model": "sql-lora"}
        )
        assert r.status_code == 200, r.text
        assert r.headers["x-kvroute-pod"] == "sim-1"


async def test_models_lists_the_union_of_what_pods_serve(rig: Rig) -> None:
    r = await rig.client.get("/v1/models")
    ids = {m["id"] for m in r.json()["data"]}
    assert ids == {MODEL, "sql-lora"}
    by_id = {m["id"]: m for m in r.json()["data"]}
    assert by_id[MODEL]["max_model_len"] == 4096
    assert by_id["sql-lora"]["parent"] == MODEL


async def test_health_and_ready(rig: Rig) -> None:
    assert (await rig.client.get("/health")).json() == {"status": "ok"}
    r = await rig.client.get("/ready")
    assert r.status_code == 200
    assert r.json()["healthy_pods"][MODEL] == 2


async def test_ready_is_503_when_a_configured_model_has_no_healthy_pod(rig: Rig) -> None:
    for p in rig.gateway.registry.all():
        p.healthy = False
    r = await rig.client.get("/ready")
    assert r.status_code == 503
    assert r.json()["ready"] is False


async def test_ready_checks_every_configured_model() -> None:
    async with running([sim(0)], models=[MODEL, "other-model"]) as r:
        resp = await r.client.get("/ready")
        assert resp.status_code == 503
        assert resp.json()["healthy_pods"] == {MODEL: 1, "other-model": 0}


async def test_unhealthy_pods_get_no_requests_and_a_model_without_healthy_pods_is_503(
    rig: Rig,
) -> None:
    rig.gateway.registry.get("sim-0").healthy = False  # type: ignore[union-attr]
    for i in range(4):
        r = await rig.client.post("/v1/chat/completions", json=chat(f"x{i}"))
        assert r.headers["x-kvroute-pod"] == "sim-1"
    rig.gateway.registry.get("sim-1").healthy = False  # type: ignore[union-attr]
    r = await rig.client.post("/v1/chat/completions", json=chat())
    await assert_openai_error(r, 503, "no_healthy_pod")


# -- every bad request -------------------------------------------------------------------


async def test_invalid_json_is_400(rig: Rig) -> None:
    r = await rig.client.post(
        "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    await assert_openai_error(r, 400, "invalid_json")


async def test_a_json_array_body_is_400(rig: Rig) -> None:
    r = await rig.client.post("/v1/chat/completions", json=[1, 2])
    await assert_openai_error(r, 400, "invalid_json")


async def test_missing_model_is_400_naming_the_param(rig: Rig) -> None:
    r = await rig.client.post("/v1/chat/completions", json={"messages": [{"role": "user"}]})
    err = await assert_openai_error(r, 400, "missing_model")
    assert err["param"] == "model"


async def test_empty_messages_is_400(rig: Rig) -> None:
    r = await rig.client.post("/v1/chat/completions", json={"model": MODEL, "messages": []})
    err = await assert_openai_error(r, 400, "invalid_messages")
    assert err["param"] == "messages"


async def test_message_without_role_is_400(rig: Rig) -> None:
    r = await rig.client.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": [{"content": "hi"}]}
    )
    err = await assert_openai_error(r, 400, "invalid_messages")
    assert err["param"] == "messages[0]"


async def test_bad_prompt_is_400(rig: Rig) -> None:
    for prompt in (None, 5, [], [1, "a"], [-1]):
        r = await rig.client.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
        await assert_openai_error(r, 400, "invalid_prompt")


async def test_non_boolean_stream_is_400(rig: Rig) -> None:
    r = await rig.client.post("/v1/chat/completions", json=chat(stream="yes"))
    await assert_openai_error(r, 400, "invalid_stream")


async def test_unknown_model_is_404_listing_the_served_models(rig: Rig) -> None:
    r = await rig.client.post("/v1/chat/completions", json={**chat(), "model": "gpt-9"})
    err = await assert_openai_error(r, 404, "model_not_found")
    assert "gpt-9" in err["message"] and MODEL in err["message"]
    assert err["type"] == "not_found_error"


async def test_prompt_over_the_pods_max_model_len_is_400(rig: Rig) -> None:
    r = await rig.client.post("/v1/chat/completions", json=chat("x" * 5000))
    err = await assert_openai_error(r, 400, "context_length_exceeded")
    assert "4096" in err["message"]


async def test_bad_requests_are_counted_by_reason(rig: Rig) -> None:
    await rig.client.post("/v1/chat/completions", json={"model": MODEL, "messages": []})
    await rig.client.post("/v1/chat/completions", json={**chat(), "model": "nope"})
    metrics = await rig.metrics()
    assert 'kvroute_bad_requests_total{reason="invalid_messages"} 1.0' in metrics
    assert 'kvroute_bad_requests_total{reason="model_not_found"} 1.0' in metrics


async def test_unknown_route_is_an_openai_404(rig: Rig) -> None:
    r = await rig.client.get("/v1/nothing")
    assert r.status_code == 404
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}


# -- passthrough endpoints ---------------------------------------------------------------


async def test_tokenize_is_relayed_to_a_pod_serving_the_model(rig: Rig) -> None:
    body = {"model": MODEL, "prompt": "hello there"}
    r = await rig.client.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    pod = {p.name: p for p in rig.pods}[r.headers["x-kvroute-pod"]]
    async with httpx.AsyncClient() as direct:
        assert r.json() == (await direct.post(f"{pod.url}/tokenize", json=body)).json()


async def test_passthrough_requests_go_to_the_least_loaded_pod_ties_rotated(rig: Rig) -> None:
    seen = set()
    for _ in range(4):
        r = await rig.client.post("/tokenize", json={"model": MODEL, "prompt": "x"})
        assert r.status_code == 200, r.text
        seen.add(r.headers["x-kvroute-pod"])
    assert seen == {"sim-0", "sim-1"}


async def test_a_passthrough_request_for_an_adapter_goes_only_to_pods_serving_it(
    rig: Rig,
) -> None:
    for _ in range(3):
        r = await rig.client.post("/tokenize", json={"model": "sql-lora", "prompt": "x"})
        assert r.headers["x-kvroute-pod"] == "sim-1"


async def test_a_passthrough_request_without_model_needs_a_single_served_model(
    rig: Rig,
) -> None:
    r = await rig.client.post("/tokenize", json={"prompt": "x"})
    err = await assert_openai_error(r, 400, "missing_model")
    assert "2 models are served" in err["message"]
    async with running([sim(0)]) as one:
        r = await one.client.post("/tokenize", json={"prompt": "x"})
        assert r.status_code == 200, r.text
        assert r.headers["x-kvroute-pod"] == "sim-0"


async def test_a_passthrough_path_the_pod_lacks_answers_with_the_pods_own_status(
    rig: Rig,
) -> None:
    r = await rig.client.post("/v1/score", json={"model": MODEL, "text_1": "a", "text_2": "b"})
    assert r.status_code == 404
    assert r.headers["x-kvroute-pod"] in {"sim-0", "sim-1"}  # the pod said 404, not us


async def test_passthrough_paths_are_a_setting() -> None:
    async with running([sim(0)], proxy={"passthrough_paths": ["/classify"]}) as rig:
        r = await rig.client.post("/tokenize", json={"model": MODEL, "prompt": "x"})
        await assert_openai_error(r, 404, "http")
        r = await rig.client.post("/classify", json={"model": MODEL, "input": "x"})
        assert r.headers["x-kvroute-pod"] == "sim-0"
    for bad in ("/v1/chat/completions", "tokenize", "/metrics"):
        with pytest.raises(ValueError, match="passthrough path"):
            Settings.model_validate({"proxy": {"passthrough_paths": [bad]}})


# -- explain + metrics ---------------------------------------------------------------------


async def test_route_explains_without_forwarding(rig: Rig) -> None:
    before = await rig.metrics()
    r = await rig.client.post("/v1/route", json=chat("explain me " * 20))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["pod"] in {"sim-0", "sim-1"}
    assert body["policy"] == "cost"
    assert body["tokenizer"] == "builtin" and body["approximate"] is False
    assert body["prompt_tokens"] > 200 and body["block_size"] == 16
    assert body["blocks"] == body["prompt_tokens"] // 16
    assert body["candidates"][0]["pod"] == body["pod"]
    assert {c["pod"] for c in body["candidates"]} == {"sim-0", "sim-1"}
    for c in body["candidates"]:
        assert {"cached_blocks", "inflight", "outstanding_prefill_tokens", "score"} <= set(c)
    # nothing was forwarded: no request counted
    assert "kvroute_requests_total{" not in before
    assert "kvroute_requests_total{" not in await rig.metrics()


async def test_metrics_count_requests_tokens_and_decisions(rig: Rig) -> None:
    r = await rig.client.post("/v1/chat/completions", json=chat("count me"))
    pod = r.headers["x-kvroute-pod"]
    m = await rig.metrics()
    assert (
        f'kvroute_requests_total{{model="{MODEL}",pod="{pod}",policy="cost",status="200"}} 1.0' in m
    )
    assert f'kvroute_prompt_tokens_total{{model="{MODEL}",pod="{pod}"}}' in m
    assert f'kvroute_predicted_cached_tokens_total{{model="{MODEL}",pod="{pod}"}}' in m
    assert "kvroute_routing_decision_seconds_count 1.0" in m
    assert 'kvroute_tokenization_seconds_count{tokenizer="builtin"} 1.0' in m
    assert f'kvroute_inflight_requests{{pod="{pod}"}} 0.0' in m


async def test_metrics_name_the_build_component_and_policy(rig: Rig) -> None:
    from router.metrics import kvroute_version
    from scoring.compiled import build_kind

    m = await rig.metrics()
    (line,) = [ln for ln in m.splitlines() if ln.startswith("kvroute_build_info{")]
    assert 'component="serve"' in line and 'policy="cost"' in line
    assert f'build="{build_kind()}"' in line  # python in a checkout, unless built in place
    assert f'python="{platform.python_version()}"' in line
    assert f'version="{kvroute_version()}"' in line and line.endswith(" 1.0")
    assert kvroute_version() == importlib.metadata.version("kvroute")


async def test_metrics_show_what_the_policy_learned_from_streamed_first_tokens(rig: Rig) -> None:
    """``cost`` starts a model at its prior rate and learns the model's from first
    tokens; the rejected observations family is there, empty, while nothing was bad."""
    learned = (
        f'kvroute_policy_learned{{model="{MODEL}",policy="cost",'
        'quantity="prefill_rate_tokens_per_s"}'
    )

    def rate(m: str) -> float:
        (line,) = [ln for ln in m.splitlines() if ln.startswith(learned)]
        return float(line.rsplit(" ", 1)[1])

    assert learned not in await rig.metrics()  # no request of the model routed yet
    r = await rig.client.post("/v1/chat/completions", json=chat("first", max_tokens=4))
    assert r.status_code == 200, r.text
    m = await rig.metrics()
    assert rate(m) == 5000.0, [ln for ln in m.splitlines() if "policy_learned" in ln]
    for i in range(3):
        r = await rig.client.post(
            "/v1/chat/completions", json=chat(f"learn {i} " * (20 + 30 * i), stream=True)
        )
        assert r.status_code == 200, r.text
    after = await rig.metrics()
    assert rate(after) != 5000.0 and math.isfinite(rate(after)) and rate(after) > 0
    assert (
        f'kvroute_policy_learned{{model="{MODEL}",policy="cost",quantity="decode_seconds"}}'
        in after
    )
    assert "# TYPE kvroute_policy_rejected_observations_total counter" in after


def test_a_departed_pod_leaves_no_series_behind() -> None:
    """Every family labelled by pod drops the pod's series when it leaves the fleet; the
    other pods' series stay as they were."""
    from router.metrics import RouterMetrics

    m = RouterMetrics()
    for pod in ("a", "b"):
        pm = m.pod_metrics(MODEL, pod, "cost")
        pm.requests(200).inc()
        pm.requests(502).inc()
        pm.served(100, 64)
        pm.inflight.inc()
        m.child(m.upstream_errors, pod, "connect").inc()
        m.scrape_errors.labels(pod).inc()
        m.index_entries.labels(pod).set(10)
        m.child(m.ttft_seconds, MODEL, pod).observe(0.02)
    m.forget_pod("a")
    text = m.render().decode()
    series = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert not [ln for ln in series if 'pod="a"' in ln]
    for name in (
        "kvroute_requests_total",
        "kvroute_prompt_tokens_total",
        "kvroute_predicted_cached_tokens_total",
        "kvroute_inflight_requests",
        "kvroute_upstream_errors_total",
        "kvroute_scrape_errors_total",
        "kvroute_index_entries",
        "kvroute_ttft_seconds_bucket",
    ):
        assert [ln for ln in series if ln.startswith(name + "{") and 'pod="b"' in ln], name
    # a pod coming back under the same name counts from zero
    m.pod_metrics(MODEL, "a", "cost").requests(200).inc()
    back = f'kvroute_requests_total{{model="{MODEL}",pod="a",policy="cost",status="200"}} 1.0'
    assert back in m.render().decode()


def test_hot_path_metrics_render_exactly_as_prometheus_client_would() -> None:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from router.metrics import HotFamily

    ours, theirs = CollectorRegistry(), CollectorRegistry()
    buckets = (0.001, 0.01, 0.1)
    h = HotFamily("histogram", "t_seconds", "doc", ("model",), buckets=buckets)
    c = HotFamily("counter", "t_requests", "doc", ("model", "pod"))
    g = HotFamily("gauge", "t_inflight", "doc", ("pod",))
    for fam in (h, c, g):
        ours.register(fam)
    ph = Histogram("t_seconds", "doc", ["model"], buckets=buckets, registry=theirs)
    pc = Counter("t_requests", "doc", ["model", "pod"], registry=theirs)
    pg = Gauge("t_inflight", "doc", ["pod"], registry=theirs)
    for v in (0.0005, 0.001, 0.001001, 0.01, 0.5, 7.0):  # bounds are inclusive
        h.labels("m").observe(v)
        ph.labels("m").observe(v)
    c.labels("m", "a").inc(3)
    pc.labels("m", "a").inc(3)
    g.labels("a").inc(2)
    g.labels("a").dec()
    pg.labels("a").inc(2)
    pg.labels("a").dec()
    g.labels("gone").inc()
    g.remove("gone")

    def lines(registry: CollectorRegistry) -> list[str]:
        text = generate_latest(registry).decode()
        return sorted(ln for ln in text.splitlines() if "_created" not in ln)

    assert lines(ours) == lines(theirs)


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
