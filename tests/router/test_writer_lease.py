"""One KV-event writer per Redis namespace: the writer lease (real Redis server)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from router.config import Settings
from router.indexer.lease import WriterLease
from router.proxy.app import create_app
from router.proxy.gateway import Gateway
from router.proxy.serve import RunningServer
from scoring.index.redis import RedisIndex
from tests.support.aio import wait_until


@pytest.fixture
async def index(redis_url: str, redis_namespace: str) -> AsyncIterator[RedisIndex]:
    ix = RedisIndex.from_url(redis_url, namespace=redis_namespace)
    yield ix
    await ix.close()


def gauge(registry: CollectorRegistry, name: str) -> float:
    for line in generate_latest(registry).decode().splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"{name} missing")


def conflict_gauge(registry: CollectorRegistry) -> float:
    return gauge(registry, "kvroute_index_writer_conflict")


def active_gauge(registry: CollectorRegistry) -> float:
    return gauge(registry, "kvroute_index_writer_active")


async def test_the_first_writer_holds_the_lease_and_a_second_one_is_told_who(
    index: RedisIndex,
) -> None:
    assert await index.claim_writer("a", 10) is None
    assert await index.claim_writer("a", 10) is None  # renewing
    assert await index.claim_writer("b", 10) == "a"
    await index.release_writer("b")  # not b's to give up
    assert await index.claim_writer("b", 10) == "a"
    await index.release_writer("a")
    assert await index.claim_writer("b", 10) is None


async def test_a_writer_that_stops_claiming_loses_the_lease_when_it_expires(
    index: RedisIndex,
) -> None:
    assert await index.claim_writer("dead", 0.3) is None  # then never renews
    assert await index.claim_writer("next", 10) == "dead"
    await asyncio.sleep(0.5)
    assert await index.claim_writer("next", 10) is None


async def test_a_second_writer_raises_the_conflict_gauge_until_the_first_leaves(
    index: RedisIndex, caplog: pytest.LogCaptureFixture
) -> None:
    first = WriterLease(index, CollectorRegistry(), lease_s=0.6, holder="first")
    second_metrics = CollectorRegistry()
    second = WriterLease(index, second_metrics, lease_s=0.6, holder="second")
    assert await index.claim_writer("first", 0.6) is None  # first is the writer
    tasks = [asyncio.create_task(first.run())]
    try:
        tasks.append(asyncio.create_task(second.run()))
        await wait_until(lambda: second.conflict == "first", "the second writer told")
        assert conflict_gauge(second_metrics) == 1
        assert "another process (first) writes the KV-event index" in caplog.text
        tasks[0].cancel()
        await first.release()
        await wait_until(lambda: second.conflict is None, "the second writer takes over")
        assert conflict_gauge(second_metrics) == 0
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_standby_waits_without_a_conflict_and_takes_over_when_the_writer_leaves(
    index: RedisIndex, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="router.indexer.lease")
    first_metrics, second_metrics = CollectorRegistry(), CollectorRegistry()
    first = WriterLease(index, first_metrics, lease_s=0.6, holder="first", standby=True)
    second = WriterLease(index, second_metrics, lease_s=0.6, holder="second", standby=True)
    tasks = [asyncio.create_task(first.run())]
    try:
        await asyncio.wait_for(first.acquired.wait(), 30)
        assert first.held and active_gauge(first_metrics) == 1
        tasks.append(asyncio.create_task(second.run()))
        await wait_until(lambda: second.waiting_for == "first", "the standby sees the writer")
        # a standby writes nothing: no conflict to report, and it is not active
        assert not second.acquired.is_set()
        assert conflict_gauge(second_metrics) == 0 and active_gauge(second_metrics) == 0
        assert "standby: first writes the KV-event index" in caplog.text
        assert "another process" not in caplog.text

        tasks[0].cancel()  # the writer stops cleanly: it gives the lease up
        await first.release()
        await asyncio.wait_for(second.acquired.wait(), 30)
        assert second.held and second.waiting_for is None
        assert active_gauge(second_metrics) == 1
        assert await index.writer() == "second"
        assert not second.lost.is_set()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_writer_whose_lease_another_process_took_is_told_to_stop(
    index: RedisIndex, caplog: pytest.LogCaptureFixture
) -> None:
    metrics = CollectorRegistry()
    lease = WriterLease(index, metrics, lease_s=0.6, holder="stalled", standby=True)
    task = asyncio.create_task(lease.run())
    try:
        await asyncio.wait_for(lease.acquired.wait(), 30)
        # what a stall past the lease looks like from Redis: someone else holds it now
        await index.release_writer("stalled")
        assert await index.claim_writer("usurper", 30) is None
        await asyncio.wait_for(lease.lost.wait(), 30)
        assert not lease.held and active_gauge(metrics) == 0
        assert "was taken by usurper" in caplog.text
        assert "this process stops writing" in caplog.text
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    await lease.release()  # not its lease any more: giving it up changes nothing
    assert await index.writer() == "usurper"


async def test_a_router_that_writes_the_shared_index_holds_the_lease_and_others_do_not(
    index: RedisIndex, redis_url: str, redis_namespace: str
) -> None:
    base = {
        "redis_url": redis_url,
        "redis_namespace": redis_namespace,
        "discovery": {"static": [{"name": "p", "url": "http://127.0.0.1:9", "models": ["m"]}]},
        "fleet": {"enabled": False},
        "health": {"enabled": False},
    }
    reader = await RunningServer(create_app(Settings.model_validate(base))).start()
    writer = await RunningServer(
        create_app(Settings.model_validate({**base, "index_writer": True}))
    ).start()
    try:
        assert gateway(reader).lease is None  # a reading replica claims nothing
        lease = gateway(writer).lease
        assert lease is not None

        async def held() -> bool:
            return await index.writer() == lease.holder

        await wait_until(held, "the writing router's claim")
    finally:
        await writer.stop()
        await reader.stop()
    assert await index.writer() is None  # given up on stop, not left to expire


def gateway(server: RunningServer) -> Gateway:
    app: Any = server.server.config.app
    g: Gateway = app.state.gateway
    return g
