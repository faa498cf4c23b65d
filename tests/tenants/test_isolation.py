"""Tenant isolation, refereed by the simulated pods' own prefix caches: a tenant's prompt
cache is its own (the router sets each request's cache_salt to the tenant's HMAC), its
stored responses are its own, and the fleet's internals are admin-only."""

from __future__ import annotations

from typing import Any

import httpx

from router.sim.pod import SimPod
from tests.support.aio import wait_until
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

#: the sims' prefill rate (tokens/s): a cold prompt of ~1,000 tokens takes ~0.25 s
PREFILL_RATE = 4000.0
LONG = "the quarterly report of a tenant that nobody else should learn about " * 60


def chat(content: str, **kw: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 2,
        **kw,
    }


async def pod_ttft_sum(pod: SimPod) -> tuple[float, float]:
    """(sum of the pod's TTFTs, its prefix-cache hits), from its own /metrics."""
    async with httpx.AsyncClient() as c:
        text = (await c.get(pod.url + "/metrics")).text
    return (
        sample(text, "vllm:time_to_first_token_seconds_sum"),
        sample(text, "vllm:prefix_cache_hits_total"),
    )


async def test_tenant_b_sending_a_prompt_of_a_gets_no_cache_hit_and_a_cold_ttft() -> None:
    sims = [sim(i, kv_events=True, time_scale=1.0, prefill_rate=PREFILL_RATE) for i in (0, 1)]
    async with (
        fleet(sims) as pods,
        router(settings_for(pods, events=True, **two_tenants())) as client,
    ):
        first = await client.post("/v1/chat/completions", json=chat(LONG), headers=auth(KEY_A))
        assert first.status_code == 200, first.text
        a_pod = first.headers["x-kvroute-pod"]
        prompt = first.json()["usage"]["prompt_tokens"]
        cold = prompt / PREFILL_RATE

        async def indexed() -> bool:
            r = await client.post("/v1/route?tenant=a", json=chat(LONG), headers=auth(ADMIN))
            return any(c["cached_tokens"] for c in r.json()["candidates"])

        await wait_until(indexed, "A's prompt to reach the index")
        # A's second turn: its own cache, on its pod
        second = await client.post("/v1/chat/completions", json=chat(LONG), headers=auth(KEY_A))
        assert second.headers["x-kvroute-pod"] == a_pod
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0.9 * prompt

        # what B would be shown before it sends: cold everywhere
        explained = await client.post("/v1/route?tenant=b", json=chat(LONG), headers=auth(ADMIN))
        assert all(c["cached_tokens"] == 0 for c in explained.json()["candidates"])
        # B sends A's prompt, with a cache_salt of its choosing: no hit anywhere
        before = {p.name: await pod_ttft_sum(p) for p in pods}
        b = await client.post(
            "/v1/chat/completions",
            json=chat(LONG, cache_salt="anything-b-likes"),
            headers=auth(KEY_B),
        )
        assert b.status_code == 200
        assert b.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        b_pod = next(p for p in pods if p.name == b.headers["x-kvroute-pod"])
        ttft_before, hits_before = before[b_pod.name]
        ttft_after, hits_after = await pod_ttft_sum(b_pod)
        assert hits_after == hits_before  # the pod's own counter: not one cached token
        assert ttft_after - ttft_before >= cold  # the sim's cold prefill, all of it


async def test_a_client_cache_salt_is_overridden_so_a_tenant_still_hits_its_own_cache() -> None:
    async with (
        fleet([sim(0, kv_events=True)]) as pods,
        router(settings_for(pods, events=True, **two_tenants())) as client,
    ):
        r = await client.post(
            "/v1/chat/completions", json=chat(LONG, cache_salt="one"), headers=auth(KEY_A)
        )
        assert r.status_code == 200
        again = await client.post(
            "/v1/chat/completions", json=chat(LONG, cache_salt="two"), headers=auth(KEY_A)
        )
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_share_cache_tenants_share_one_salt_and_see_each_others_hits() -> None:
    overrides = two_tenants(share_cache=True)
    overrides["tenants"][1]["share_cache"] = True
    async with fleet([sim(0)]) as pods, router(settings_for(pods, **overrides)) as client:
        await client.post("/v1/chat/completions", json=chat(LONG), headers=auth(KEY_A))
        b = await client.post("/v1/chat/completions", json=chat(LONG), headers=auth(KEY_B))
        assert b.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_missing_or_wrong_keys_are_401_before_anything_reaches_a_pod() -> None:
    async with fleet([sim(0)]) as pods, router(settings_for(pods, **two_tenants())) as client:
        for headers in ({}, auth("wrong-key"), auth(ADMIN)):
            r = await client.post("/v1/chat/completions", json=chat("hi"), headers=headers)
            assert r.status_code == 401
            assert r.json()["error"]["type"] == "authentication_error"
        m = await client.get("/metrics", headers=auth(ADMIN))
        assert sample(m.text, "kvroute_tenant_requests_total", tenant="unauthenticated") == 3
        assert sample(m.text, "vllm:request_success_total") == 0


async def test_a_model_the_tenant_may_not_use_is_404_exactly_like_one_that_does_not_exist() -> None:
    async with (
        fleet([sim(0), sim(1, model="other-model")]) as pods,
        router(settings_for(pods, **two_tenants(models=[MODEL]))) as client,
    ):
        hidden = await client.post(
            "/v1/chat/completions",
            json={**chat("hi"), "model": "other-model"},
            headers=auth(KEY_A),
        )
        absent = await client.post(
            "/v1/chat/completions",
            json={**chat("hi"), "model": "no-such-model"},
            headers=auth(KEY_A),
        )
        assert hidden.status_code == absent.status_code == 404
        h, a = hidden.json()["error"], absent.json()["error"]
        assert h["message"].replace("other-model", "X") == a["message"].replace(
            "no-such-model", "X"
        )
        assert "other-model" not in a["message"]  # the served list is the tenant's
        models = await client.get("/v1/models", headers=auth(KEY_A))
        assert [m["id"] for m in models.json()["data"]] == [MODEL]
        b_models = await client.get("/v1/models", headers=auth(KEY_B))
        assert {m["id"] for m in b_models.json()["data"]} == {MODEL, "other-model"}


async def test_introspection_needs_the_admin_key_and_can_be_turned_off() -> None:
    async with fleet([sim(0)]) as pods, router(settings_for(pods, **two_tenants())) as client:
        for method, path in (
            ("POST", "/v1/route"),
            ("GET", "/metrics"),
            ("GET", "/openapi.json"),
        ):
            body = chat("hi") if method == "POST" else None
            r = await client.request(method, path, json=body, headers=auth(KEY_A))
            assert r.status_code == 403, path
            assert "sim-0" not in r.text and "127.0.0.1" not in r.text
            ok = await client.request(method, path, json=body, headers=auth(ADMIN))
            assert ok.status_code == 200, path
        ready = await client.get("/ready")
        assert ready.json() == {"ready": True}  # no model names without the admin key
        off = {"route_endpoint": "off", "metrics_endpoint": "off", "openapi_endpoint": "off"}
        async with router(settings_for(pods, security=off, **two_tenants())) as client:
            for method, path in (
                ("POST", "/v1/route"),
                ("GET", "/metrics"),
                ("GET", "/openapi.json"),
            ):
                body = chat("hi") if method == "POST" else None
                r = await client.request(method, path, json=body, headers=auth(ADMIN))
                assert r.status_code == 404, path


async def test_tenant_facing_errors_name_no_pod_url_and_the_log_keeps_the_detail(
    caplog: Any,
) -> None:
    async with fleet([sim(0)]) as pods:
        dead = pods[0].url
        await pods[0].stop()  # the pod is gone: connecting to it fails
        settings = settings_for(
            pods, health={"enabled": False}, proxy={"retries": 0}, **two_tenants()
        )
        async with router(settings) as client:
            r = await client.post("/v1/chat/completions", json=chat("hi"), headers=auth(KEY_A))
            assert r.status_code == 502
            port = dead.rsplit(":", 1)[1]
            assert port not in r.text and "127.0.0.1" not in r.text
            assert r.json()["error"]["code"] == "connect"
        assert any(port in rec.getMessage() for rec in caplog.records)


async def test_a_trusted_gateway_header_names_the_tenant_only_from_its_networks() -> None:
    async with fleet([sim(0)]) as pods:
        trusted = {"tenant_header": "x-kvroute-tenant", "tenant_header_networks": ["127.0.0.0/8"]}
        async with router(settings_for(pods, security=trusted, **two_tenants())) as client:
            r = await client.post(
                "/v1/chat/completions", json=chat("hi"), headers={"x-kvroute-tenant": "b"}
            )
            assert r.status_code == 200
            m = await client.get("/metrics", headers=auth(ADMIN))
            assert sample(m.text, "kvroute_tenant_requests_total", tenant="b", status="200") == 1
            unknown = await client.post(
                "/v1/chat/completions", json=chat("hi"), headers={"x-kvroute-tenant": "zz"}
            )
            assert unknown.status_code == 401
        elsewhere = {"tenant_header": "x-kvroute-tenant", "tenant_header_networks": ["10.0.0.0/8"]}
        async with router(settings_for(pods, security=elsewhere, **two_tenants())) as client:
            r = await client.post(
                "/v1/chat/completions", json=chat("hi"), headers={"x-kvroute-tenant": "b"}
            )
            assert r.status_code == 401  # 127.0.0.1 is not a trusted gateway: the key decides
