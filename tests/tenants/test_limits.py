"""Per-tenant limits: requests and tokens per minute as token buckets, 429 with an
OpenAI error and Retry-After, shared by replicas through Redis, local when Redis is
down; counted per tenant."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx

from router.tenants.limits import LocalBuckets
from tests.support.redis_server import FaultyServer
from tests.tenants.rig import (
    ADMIN,
    KEY_A,
    KEY_B,
    MODEL,
    auth,
    fleet,
    router,
    sample,
    settings_for,
    sim,
    two_tenants,
)


def chat(content: str = "hi", **kw: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 4,
        **kw,
    }


def test_a_bucket_refills_at_the_limit_per_minute() -> None:
    now = [0.0]
    b = LocalBuckets(clock=lambda: now[0])
    assert all(b.take("k", 6, 1, 1) == 0 for _ in range(6))  # one minute's worth at once
    assert b.take("k", 6, 1, 1) == 10.0  # then one every 10 s
    now[0] = 10.0
    assert b.take("k", 6, 1, 1) == 0
    assert b.take("k", 6, 5, -1) == 0  # a charge without a check goes below zero
    assert b.take("k", 6, 1, 1) == 60.0


async def test_requests_past_the_rate_are_429_with_retry_after_and_counted() -> None:
    limits = {"requests_per_minute": 3}
    async with (
        fleet([sim(0)]) as pods,
        router(settings_for(pods, **two_tenants(limits=limits))) as c,
    ):
        codes = [
            (await c.post("/v1/chat/completions", json=chat(), headers=auth(KEY_A))).status_code
            for _ in range(3)
        ]
        assert codes == [200, 200, 200]
        r = await c.post("/v1/chat/completions", json=chat(), headers=auth(KEY_A))
        assert r.status_code == 429
        assert r.json()["error"]["type"] == "rate_limit_error"
        assert 1 <= int(r.headers["retry-after"]) <= 20
        # B has no limit and is not affected
        assert (
            await c.post("/v1/chat/completions", json=chat(), headers=auth(KEY_B))
        ).status_code == 200
        m = (await c.get("/metrics", headers=auth(ADMIN))).text
        assert (
            sample(m, "kvroute_tenant_limited_total", tenant="a", limit="requests_per_minute") == 1
        )
        assert sample(m, "kvroute_tenant_requests_total", tenant="a", status="429") == 1
        assert sample(m, "kvroute_tenant_requests_total", tenant="a", status="200") == 3


async def test_tokens_per_minute_count_prompt_and_completion_tokens() -> None:
    async with fleet([sim(0)]) as pods:
        async with router(settings_for(pods)) as probe:  # no tenants: what one request costs
            usage = (await probe.post("/v1/chat/completions", json=chat())).json()["usage"]
        cost = usage["prompt_tokens"] + usage["completion_tokens"]
        limits = {"tokens_per_minute": 2.5 * cost}  # two requests fit, a third does not
        async with router(settings_for(pods, **two_tenants(limits=limits))) as c:
            for _ in range(2):
                ok = await c.post("/v1/chat/completions", json=chat(), headers=auth(KEY_A))
                assert ok.status_code == 200
            r = await c.post("/v1/chat/completions", json=chat(), headers=auth(KEY_A))
            assert r.status_code == 429 and "tokens per minute" in r.json()["error"]["message"]


@contextlib.asynccontextmanager
async def two_replicas(
    pods: Any, **overrides: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient]]:
    async with (
        router(settings_for(pods, **overrides)) as one,
        router(settings_for(pods, **overrides)) as two,
    ):
        yield one, two


async def test_two_replicas_sharing_redis_draw_from_one_bucket(
    redis_url: str, redis_namespace: str
) -> None:
    shared = {"redis_url": redis_url, "redis_namespace": redis_namespace}
    limits = {"requests_per_minute": 4}
    async with (
        fleet([sim(0)]) as pods,
        two_replicas(pods, **shared, **two_tenants(limits=limits)) as (one, two),
    ):
        codes = []
        for i in range(6):
            client = one if i % 2 == 0 else two
            codes.append(
                (
                    await client.post("/v1/chat/completions", json=chat(), headers=auth(KEY_A))
                ).status_code
            )
        assert codes == [200, 200, 200, 200, 429, 429]


async def test_with_redis_down_each_replica_limits_on_its_own(
    tmp_path: Any, redis_namespace: str
) -> None:
    with FaultyServer(tmp_path) as server:
        shared: dict[str, Any] = {"redis_url": server.url, "redis_namespace": redis_namespace}
        limits = {"requests_per_minute": 2}
        async with (
            fleet([sim(0)]) as pods,
            router(settings_for(pods, **shared, **two_tenants(limits=limits))) as c,
        ):
            server.kill()
            codes = [
                (await c.post("/v1/chat/completions", json=chat(), headers=auth(KEY_A))).status_code
                for _ in range(3)
            ]
            assert codes == [200, 200, 429]  # degraded, not unlimited and not failed
            m = (await c.get("/metrics", headers=auth(ADMIN))).text
            assert sample(m, "kvroute_tenant_limit_degraded_total") >= 1
