"""A stored response belongs to the tenant that created it: another tenant's GET,
cancel and previous_response_id get the same 404 as an unknown id, with the owners in
memory and in Redis."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from tests.tenants.rig import (
    KEY_A,
    KEY_B,
    MODEL,
    auth,
    fleet,
    router,
    settings_for,
    sim,
    two_tenants,
)


async def create(client: httpx.AsyncClient, key: str, **body: Any) -> httpx.Response:
    payload = {"model": MODEL, "max_output_tokens": 4, "input": "remember this", **body}
    return await client.post("/v1/responses", json=payload, headers=auth(key))


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_another_tenant_cannot_get_cancel_or_continue_a_response(
    store: str, redis_url: str, redis_namespace: str
) -> None:
    extra: dict[str, Any] = (
        {"redis_url": redis_url, "redis_namespace": redis_namespace} if store == "redis" else {}
    )
    async with (
        fleet([sim(0), sim(1)]) as pods,
        router(settings_for(pods, **two_tenants(), **extra)) as client,
    ):
        made = await create(client, KEY_A)
        assert made.status_code == 200, made.text
        rid = made.json()["id"]
        # A's own: found, continued
        assert (await client.get(f"/v1/responses/{rid}", headers=auth(KEY_A))).status_code == 200
        follow = await create(client, KEY_A, previous_response_id=rid, input="and then?")
        assert follow.status_code == 200
        assert follow.headers["x-kvroute-pod"] == made.headers["x-kvroute-pod"]

        unknown = await client.get("/v1/responses/resp_unknown", headers=auth(KEY_B))
        for r in (
            await client.get(f"/v1/responses/{rid}", headers=auth(KEY_B)),
            await client.post(f"/v1/responses/{rid}/cancel", headers=auth(KEY_B)),
        ):
            assert r.status_code == unknown.status_code == 404
            assert r.json()["error"]["message"] == unknown.json()["error"]["message"].replace(
                "resp_unknown", rid
            )
        stolen = await create(client, KEY_B, previous_response_id=rid, input="what did A say?")
        assert stolen.status_code == 404
        assert stolen.json()["error"]["code"] == "response_not_found"
        if store == "redis":
            store_client = aioredis.Redis.from_url(redis_url)
            try:
                value = await store_client.get(f"{redis_namespace}:resp:{rid}")
            finally:
                await store_client.aclose()
            assert value == made.headers["x-kvroute-pod"].encode() + b"\x00a"
