"""The load view: vLLM /metrics parsing, scraping with staleness, router-tracked load
(in memory and shared through a real Redis by two router replicas)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from router.config import Settings
from router.fleet.load import MemoryLoadStore, RequestLoad
from router.fleet.pods import PodRegistry, PodSpec
from router.fleet.scrape import MetricsScraper, parse_vllm_metrics
from router.proxy.app import create_app
from router.proxy.serve import RunningServer
from tests.support.ports import refused_port

VLLM_METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 7.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.25
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",cache_dtype="auto",enable_prefix_caching="True",engine="0",num_gpu_blocks="1024"} 1.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0
"""  # noqa: E501


def test_vllm_metrics_are_summed_over_engines() -> None:
    s = parse_vllm_metrics(VLLM_METRICS)
    assert s.running == 5
    assert s.waiting == 7
    assert s.kv_usage == pytest.approx(0.375)
    assert s.block_size == 32
    assert s.capacity_blocks == 1024  # num_gpu_blocks


def test_the_cache_capacity_of_data_parallel_engines_adds_up() -> None:
    info = 'vllm:cache_config_info{{block_size="16",engine="{e}",num_gpu_blocks="{n}"}} 1.0\n'
    s = parse_vllm_metrics(info.format(e=0, n=500) + info.format(e=1, n=700))
    assert s.capacity_blocks == 1200
    # an engine that has not sized its cache yet says "None": unknown, not zero
    assert parse_vllm_metrics(info.format(e=0, n="None")).capacity_blocks is None


def test_missing_series_are_unknown_not_zero() -> None:
    s = parse_vllm_metrics("# nothing here\nother_metric 1\n")
    assert s.running is None and s.waiting is None and s.kv_usage is None
    assert s.block_size is None and s.capacity_blocks is None


HISTOGRAMS = """\
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 12.0
vllm:time_to_first_token_seconds_count{engine="1",model_name="m"} 3.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 4.5
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 9.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 4.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 2.5
vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 100.0
vllm:request_decode_time_seconds_sum{engine="0",model_name="m"} 30.0
vllm:request_decode_time_seconds_count{engine="0",model_name="m"} 13.0
"""


def test_the_engine_s_first_tokens_finished_requests_and_latency_histograms_are_read() -> None:
    s = parse_vllm_metrics(VLLM_METRICS + HISTOGRAMS)
    assert (s.first_tokens, s.finished) == (15.0, 13.0)  # summed over engines and reasons
    c = s.counters
    assert (c.running, c.itl_sum_s, c.itl_count) == (5, 2.5, 100.0)
    assert (c.decode_sum_s, c.decode_count) == (30.0, 13.0)


def test_an_older_engine_s_time_per_output_token_stands_for_the_inter_token_latency() -> None:
    older = HISTOGRAMS.replace("inter_token_latency", "time_per_output_token")
    assert parse_vllm_metrics(older).counters.itl_count == 100.0


def test_a_bad_histogram_sample_leaves_its_series_unknown_and_the_scrape_stands() -> None:
    bad = HISTOGRAMS.replace('_count{engine="1",model_name="m"} 3.0', "_count 3e999")
    s = parse_vllm_metrics(VLLM_METRICS + bad + "vllm:request_decode_time_seconds_sum -1\n")
    assert s.first_tokens is None and s.counters.decode_sum_s is None
    assert s.running == 5 and s.finished == 13.0


@pytest.mark.parametrize(
    "line",
    [
        'vllm:num_requests_waiting{engine="0"} -3',
        'vllm:num_requests_running{engine="0"} NaN',
        'vllm:kv_cache_usage_perc{engine="0"} +Inf',
        "vllm:prefix_cache_hits_total -1",
    ],
)
def test_a_negative_or_non_finite_count_fails_the_scrape_by_name(line: str) -> None:
    """A bad publisher's count is not taken (a negative waiting count would make its
    pod look idler than idle): the scrape fails, naming the series and the value."""
    name = line.split("{")[0].split(" ")[0]
    with pytest.raises(ValueError, match=f"{name} is .*not a count"):
        parse_vllm_metrics(VLLM_METRICS + line + "\n")


def test_older_gpu_cache_usage_name_is_understood() -> None:
    s = parse_vllm_metrics('vllm:gpu_cache_usage_perc{model_name="m"} 0.9\n')
    assert s.kv_usage == pytest.approx(0.9)


def test_garbage_lines_are_skipped() -> None:
    s = parse_vllm_metrics(
        'vllm:num_requests_running{x="1"} notanumber\nvllm:num_requests_waiting 4\n'
    )
    assert s.running is None and s.waiting == 4


async def test_request_load_counts_prefill_until_first_token_and_inflight_until_end() -> None:
    store = MemoryLoadStore()
    a = RequestLoad(store, "p", 100)
    b = RequestLoad(store, "p", 40)
    await a.begin()
    await b.begin()
    assert await store.snapshot(["p", "q"]) == {"p": (2, 140), "q": (0, 0)}
    await a.first_token()
    await a.first_token()  # idempotent
    assert await store.snapshot(["p"]) == {"p": (2, 40)}
    await b.end()  # ending releases the prefill too
    await b.end()
    assert await store.snapshot(["p"]) == {"p": (1, 0)}
    await a.end()
    assert await store.snapshot(["p"]) == {"p": (0, 0)}


async def test_request_load_on_the_memory_store_applies_counts_synchronously_once() -> None:
    store = MemoryLoadStore()
    a = RequestLoad(store, "p", 100)
    assert a.local is store
    a.begin_now()
    assert await store.snapshot(["p"]) == {"p": (1, 100)}  # visible without an await
    a.first_token_now()
    a.first_token_now()  # idempotent
    assert await store.snapshot(["p"]) == {"p": (1, 0)}
    a.end_now()
    a.end_now()
    await a.end()  # the async twin agrees it already ended
    assert await store.snapshot(["p"]) == {"p": (0, 0)}


def test_memory_store_counts_read_what_the_snapshot_reads() -> None:
    store = MemoryLoadStore()
    store.begin_now("p", 100)
    store.begin_now("p", 20)
    store.prefill_done_now("p", 100)
    inflight, prefill = store.counts()
    assert store.snapshot_now(["p", "q"]) == {"p": (2, 20), "q": (0, 0)}
    assert (inflight("p", 0), prefill("p", 0)) == (2, 20)
    assert (inflight("q", 0), prefill("q", 0)) == (0, 0)


def _metrics_app(text: list[str]) -> Starlette:
    async def metrics(request: Request) -> Response:
        return Response(text[0].encode())

    async def models(request: Request) -> Response:
        return JSONResponse(
            {
                "data": [
                    {"id": "m", "max_model_len": 2048},
                    {"id": "m-lora", "parent": "m", "max_model_len": 2048},
                ]
            }
        )

    return Starlette(routes=[Route("/metrics", metrics), Route("/v1/models", models)])


async def test_scraper_reads_pods_and_treats_old_values_as_unknown() -> None:
    text = [VLLM_METRICS]
    errors: list[str] = []
    async with RunningServer(_metrics_app(text)) as srv, httpx.AsyncClient() as client:
        registry = PodRegistry()
        registry.set_pods(
            [
                PodSpec("up", srv.url, models=("m",)),
                PodSpec("down", f"http://127.0.0.1:{refused_port()}", models=("m",)),
            ]
        )
        scraper = MetricsScraper(
            registry, client, interval_s=60, timeout_s=2, stale_after_s=5, on_error=errors.append
        )
        await scraper.scrape_all()
        got = scraper.get("up")
        assert got is not None and got.waiting == 7 and got.running == 5
        assert scraper.block_size(["down", "up"]) == 32
        assert scraper.model_max_len("m", ["up"]) == 2048
        assert scraper.parents == {"m-lora": "m"}
        # the dead pod is unknown and counted, never zero load
        assert scraper.get("down") is None
        assert errors == ["down"]
        # staleness: the same scrape seen 6 s later is unknown
        assert scraper.get("up", now=time.monotonic() + 6) is None
        # a new scrape refreshes the values
        text[0] = VLLM_METRICS.replace("} 7.0", "} 1.0")
        await scraper.scrape_all()
        assert scraper.get("up").waiting == 1  # type: ignore[union-attr]
        scraper.forget("up")
        assert scraper.get("up") is None


# -- shared load across replicas (Redis) ---------------------------------------------------


def _held_stream_app(release: asyncio.Event, started: asyncio.Event) -> Starlette:
    async def gen(request: Request) -> Response:
        started.set()

        async def body() -> AsyncIterator[bytes]:
            yield b"data: first\n\n"
            await release.wait()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(body(), media_type="text/event-stream")

    async def models(request: Request) -> Response:
        return JSONResponse({"data": [{"id": "m"}]})

    return Starlette(
        routes=[
            Route("/v1/chat/completions", gen, methods=["POST"]),
            Route("/v1/models", models),
            Route("/health", lambda r: Response(b"")),
        ]
    )


def _router_settings(pod_url: str, **kw: object) -> Settings:
    return Settings.model_validate(
        {
            "discovery": {"static": [{"name": "p0", "url": pod_url, "models": ["m"]}]},
            "events": {"enabled": False},
            "fleet": {"enabled": False},
            **kw,
        }
    )


async def _inflight_seen_by(client: httpx.AsyncClient) -> tuple[int, int]:
    r = await client.post(
        "/v1/route", json={"model": "m", "messages": [{"role": "user", "content": "probe"}]}
    )
    c = r.json()["candidates"][0]
    return c["inflight"], c["outstanding_prefill_tokens"]


async def test_two_replicas_share_in_flight_load_through_redis(
    redis_url: str, redis_namespace: str
) -> None:
    release, started = asyncio.Event(), asyncio.Event()
    async with RunningServer(_held_stream_app(release, started)) as pod:
        kw = {"redis_url": redis_url, "redis_namespace": redis_namespace}
        async with (
            RunningServer(create_app(_router_settings(pod.url, **kw))) as a,
            RunningServer(create_app(_router_settings(pod.url, **kw))) as b,
            httpx.AsyncClient(base_url=a.url, timeout=30) as ca,
            httpx.AsyncClient(base_url=b.url, timeout=30) as cb,
        ):
            assert await _inflight_seen_by(cb) == (0, 0)
            body = {"model": "m", "messages": [{"role": "user", "content": "hold"}], "stream": True}
            async with ca.stream("POST", "/v1/chat/completions", json=body) as r:
                chunks = r.aiter_raw()
                await chunks.__anext__()  # first token: prefill done, still in flight
                assert await _inflight_seen_by(cb) == (1, 0)
                release.set()
                async for _ in chunks:
                    pass
            for _ in range(500):  # replica A releases the slot after the stream's end
                if await _inflight_seen_by(cb) == (0, 0):
                    break
                await asyncio.sleep(0.02)
            assert await _inflight_seen_by(cb) == (0, 0)


async def test_prefill_tokens_are_outstanding_until_the_first_token() -> None:
    release, started = asyncio.Event(), asyncio.Event()

    # an upstream that sends headers only after `release`: prefill is still running
    async def gen(request: Request) -> Response:
        started.set()
        await release.wait()
        return JSONResponse({"ok": True})

    async def models(request: Request) -> Response:
        return JSONResponse({"data": [{"id": "m"}]})

    app = Starlette(
        routes=[Route("/v1/chat/completions", gen, methods=["POST"]), Route("/v1/models", models)]
    )
    async with RunningServer(app) as pod:
        settings = _router_settings(pod.url, health={"enabled": False})
        async with (
            RunningServer(create_app(settings)) as router,
            httpx.AsyncClient(base_url=router.url, timeout=30) as client,
        ):
            body = {"model": "m", "messages": [{"role": "user", "content": "p" * 100}]}
            task = asyncio.create_task(client.post("/v1/chat/completions", json=body))
            await asyncio.wait_for(started.wait(), 10)
            inflight, prefill = await _inflight_seen_by(client)
            assert inflight == 1 and prefill > 100
            release.set()
            assert (await task).status_code == 200
            assert await _inflight_seen_by(client) == (0, 0)
