"""The Responses API through the router (``/v1/responses``): stored responses live in the
pod that created them, so follow-ups, GET and cancel go to that pod; new responses that
convert exactly to a chat prompt are routed cache-aware, the rest least-loaded.

Real components: simulated vLLM pods over loopback HTTP, the router served by uvicorn,
a real Redis for the shared owner store.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from router.config import Settings
from router.decision.owners import MemoryOwnerStore
from router.decision.responses import Unscored, to_chat
from router.fleet.embedded import static_pods
from router.proxy.app import create_app
from router.proxy.response_ids import CreatedSniffer, id_from_body
from router.proxy.serve import RunningServer
from router.tokenize import ChatEncoder, load_tokenizer
from router.tokenize.hf import HFTokenizer
from scoring.blocks import BlockHasher
from tests.fixtures.tokenizers.build import fixture_dirs
from tests.router.app_rig import MODEL, running, sim

THREE = [sim(0), sim(1), sim(2)]


def sse_events(raw: bytes) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of every event of an SSE body."""
    out = []
    for block in raw.decode().split("\n\n"):
        if not block.strip():
            continue
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        out.append((lines["event"], json.loads(lines["data"])))
    return out


async def create(
    client: httpx.AsyncClient, stream: bool = False, **body: Any
) -> tuple[str, str, dict[str, Any]]:
    """POST /v1/responses -> (response id, answering pod, final response object)."""
    payload = {"model": MODEL, "max_output_tokens": 8, **body}
    if not stream:
        r = await client.post("/v1/responses", json=payload)
        assert r.status_code == 200, r.text
        return r.json()["id"], r.headers["x-kvroute-pod"], r.json()
    async with client.stream("POST", "/v1/responses", json={**payload, "stream": True}) as r:
        assert r.status_code == 200, (await r.aread()).decode()
        raw = b"".join([c async for c in r.aiter_raw()])
        pod = r.headers["x-kvroute-pod"]
    events = sse_events(raw)
    assert events[0][0] == "response.created"
    assert events[-1][0] == "response.completed"
    final = events[-1][1]["response"]
    assert final["id"] == events[0][1]["response"]["id"]
    return final["id"], pod, final


def metric(text: str, line_prefix: str) -> float:
    """The value of the one sample starting with ``line_prefix`` (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(line_prefix):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# -- stickiness ----------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_a_chain_of_follow_ups_stays_on_the_pod_that_created_the_first(
    stream: bool,
) -> None:
    async with running(THREE) as rig:
        for chain in range(3):
            rid, pod, _ = await create(rig.client, stream, input=f"chain {chain}: hello")
            for turn in range(2):
                # noise between turns: other pods become the least loaded / best scored
                await create(rig.client, input=f"unrelated {chain}.{turn}")
                rid, answered, final = await create(
                    rig.client, stream, input=f"turn {turn}", previous_response_id=rid
                )
                assert answered == pod
                assert final["status"] == "completed"
        m = await rig.metrics()
        assert metric(m, 'kvroute_responses_affinity_total{result="owner"}') == 6.0


async def test_get_and_cancel_go_to_the_owner_pod() -> None:
    async with running(THREE) as rig:
        rid, pod, created = await create(rig.client, input="keep me")
        got = await rig.client.get(f"/v1/responses/{rid}")
        assert got.status_code == 200, got.text
        assert got.headers["x-kvroute-pod"] == pod
        assert got.json() == created
        # a finished response cannot be cancelled (vLLM says so, 400): the owner said it
        cancel = await rig.client.post(f"/v1/responses/{rid}/cancel")
        assert cancel.headers["x-kvroute-pod"] == pod
        assert cancel.status_code == 400
        assert "Cannot cancel" in cancel.json()["error"]["message"]


@pytest.mark.parametrize("method,path", [("GET", ""), ("POST", "/cancel")])
async def test_get_or_cancel_of_an_unknown_id_is_an_openai_404_naming_it(
    method: str, path: str
) -> None:
    async with running(THREE) as rig:
        r = await rig.client.request(method, f"/v1/responses/resp_nobody{path}")
        assert r.status_code == 404
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert "resp_nobody" in err["message"]
        assert err["code"] == "response_not_found" and err["param"] == "response_id"
        m = await rig.metrics()
        assert metric(m, 'kvroute_responses_affinity_total{result="unknown"}') == 1.0
        assert metric(m, 'kvroute_bad_requests_total{reason="response_not_found"}') == 1.0


async def test_a_follow_up_to_an_unknown_id_is_relayed_to_some_pod_which_answers_404() -> None:
    async with running(THREE) as rig:
        r = await rig.client.post(
            "/v1/responses",
            json={"model": MODEL, "input": "hi", "previous_response_id": "resp_nobody"},
        )
        assert r.status_code == 404
        assert r.headers["x-kvroute-pod"] in {"sim-0", "sim-1", "sim-2"}
        assert "resp_nobody" in r.json()["error"]["message"]
        m = await rig.metrics()
        assert metric(m, 'kvroute_responses_affinity_total{result="unknown"}') == 1.0
        assert metric(m, 'kvroute_responses_unscored_total{reason="previous_response_id"}') == 1


async def test_when_the_owner_pod_is_gone_a_follow_up_is_counted_and_routed_elsewhere() -> None:
    async with running(THREE) as rig:
        rid, pod, _ = await create(rig.client, input="my pod will fail")
        state = rig.gateway.registry.get(pod)
        assert state is not None
        state.healthy = False  # no longer a candidate
        r = await rig.client.post(
            "/v1/responses",
            json={"model": MODEL, "input": "still there?", "previous_response_id": rid},
        )
        assert r.headers["x-kvroute-pod"] != pod
        assert r.status_code == 404  # the other pod never stored it: its answer is relayed
        m = await rig.metrics()
        assert metric(m, 'kvroute_responses_affinity_total{result="owner_gone"}') == 1.0


async def test_with_redis_a_second_replica_finds_the_owner(
    redis_url: str, redis_namespace: str
) -> None:
    async with running(THREE, redis_url=redis_url, redis_namespace=redis_namespace) as a:
        settings = Settings.model_validate(
            {
                "discovery": {"static": [p.model_dump() for p in static_pods(a.pods)]},
                "events": {"enabled": False},
                "fleet": {"enabled": False},
                "redis_url": redis_url,
                "redis_namespace": redis_namespace,
            }
        )
        b = await RunningServer(create_app(settings)).start()
        try:
            async with httpx.AsyncClient(base_url=b.url, timeout=30) as client_b:
                for stream in (False, True):
                    rid, pod, _ = await create(a.client, stream, input=f"made on A {stream}")
                    follow, answered, _ = await create(
                        client_b, stream, input="continued on B", previous_response_id=rid
                    )
                    assert answered == pod
                    got = await client_b.get(f"/v1/responses/{follow}")
                    assert got.status_code == 200 and got.headers["x-kvroute-pod"] == pod
                    assert got.json()["previous_response_id"] == rid
            r = aioredis.Redis.from_url(redis_url)
            try:
                assert (await r.get(f"{redis_namespace}:resp:{rid}")) == pod.encode()
                assert 0 < await r.ttl(f"{redis_namespace}:resp:{rid}") <= 86_400
            finally:
                await r.aclose()
        finally:
            await b.stop()


# -- scoring -------------------------------------------------------------------------------

MESSAGES_INPUT = [
    {"role": "developer", "content": "Answer in one line."},
    {
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": "a long shared question " * 30}],
    },
    {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "output_text", "text": "an earlier answer"}],
    },
    {"role": "user", "content": "and now?"},
]


async def test_a_message_list_request_is_scored_and_a_function_call_input_is_not() -> None:
    async with running([sim(0, kv_events=True), sim(1, kv_events=True)], events=True) as rig:
        body: dict[str, Any] = {
            "model": MODEL,
            "instructions": "Be brief.",
            "input": MESSAGES_INPUT,
        }
        _, pod, first = await create(rig.client, **body)
        explained: dict[str, Any] = {}
        for _ in range(500):  # the pod's BlockStored events reach the index
            explained = (await rig.client.post("/v1/route", json=body)).json()
            if explained["candidates"][0]["cached_blocks"].get("GPU", 0) > 0:
                break
            await asyncio.sleep(0.02)
        assert explained["pod"] == pod
        assert explained["blocks"] == explained["prompt_tokens"] // 16 > 0
        assert explained["candidates"][0]["cached_blocks"]["GPU"] == explained["blocks"]
        # the router's prompt is the pod's prompt
        assert explained["prompt_tokens"] == first["usage"]["input_tokens"]
        _, again, _ = await create(rig.client, **body)
        assert again == pod
        m = await rig.metrics()
        assert metric(m, f'kvroute_predicted_cached_tokens_total{{model="{MODEL}",pod="{pod}"}}')
        assert "kvroute_responses_unscored_total{" not in m

        tool_turn = [
            {"role": "user", "content": "weather in Paris?"},
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "weather",
                "arguments": '{"city": "Paris"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ]
        _, _, answered = await create(rig.client, input=tool_turn)
        assert answered["status"] == "completed"
        m = await rig.metrics()
        assert metric(m, 'kvroute_responses_unscored_total{reason="function_call"}') == 1.0


def _chat_equivalent() -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "developer", "content": "Answer in one line."},
            {"role": "user", "content": [{"type": "text", "text": "a long shared question " * 30}]},
            {"role": "assistant", "content": "an earlier answer"},
            {"role": "user", "content": "and now?"},
        ],
        "tools": [
            {
                "type": "function",
                "function": {
                    "name": "weather",
                    "description": "the weather in a city",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                },
            }
        ],
    }


@pytest.mark.parametrize("tokenizer", ["builtin", "chatml", "llama3", "zephyr", "parts"])
async def test_a_converted_request_encodes_as_vllm_renders_the_equivalent_chat(
    tokenizer: str,
) -> None:
    """The converted request is the equivalent chat request, rendered by the same
    template; vLLM 0.32 then tokenizes a Responses prompt with add_special_tokens=True
    (chat: False), so a tokenizer that adds a BOS (llama3 here) gives one token more,
    and the others the very ids of the chat."""
    spec = "builtin" if tokenizer == "builtin" else str(fixture_dirs()[tokenizer])
    responses_body = {
        "model": MODEL,
        "instructions": "Be brief.",
        "input": MESSAGES_INPUT,
        "tools": [
            {
                "type": "function",
                "name": "weather",
                "description": "the weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            }
        ],
    }
    chat_body = _chat_equivalent()
    async with running([sim(0)], tokenizer=spec) as rig:
        router = rig.gateway.router
        converted = await router.decide("responses", responses_body, {})
        chat = await router.decide("chat", chat_body, {})
    tok = load_tokenizer(spec)
    hasher = BlockHasher(16, MODEL)
    chat_ids = (
        ChatEncoder(tok, hasher)
        .encode_chat(chat_body["messages"], tools=chat_body["tools"])
        .token_ids
    )
    if isinstance(tok, HFTokenizer):
        text = tok.render_chat(chat_body["messages"], tools=chat_body["tools"])
        expected = tok.encode_text(text, add_special_tokens=True)
    else:
        expected = chat_ids
    assert chat.route.prompt_tokens == len(chat_ids) > 100
    assert converted.route.prompt_tokens == len(expected)
    assert converted.route.block_keys == hasher.keys(expected)
    if tokenizer == "llama3":
        assert expected == [expected[0], *chat_ids]  # the BOS, once more
    else:
        assert expected == chat_ids
        assert converted.route.block_keys == chat.route.block_keys


async def test_model_is_optional_when_one_model_is_served_and_input_is_required() -> None:
    async with running(THREE) as rig:
        r = await rig.client.post("/v1/responses", json={"input": "no model named"})
        assert r.status_code == 200, r.text
        r = await rig.client.post("/v1/responses", json={"model": MODEL})
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "invalid_input"
        assert r.json()["error"]["param"] == "input"
        m = await rig.metrics()
        assert metric(m, 'kvroute_bad_requests_total{reason="invalid_input"}') == 1.0


async def test_route_explains_a_sticky_follow_up() -> None:
    async with running(THREE) as rig:
        rid, pod, _ = await create(rig.client, input="explain where my follow-up goes")
        r = await rig.client.post(
            "/v1/route", json={"model": MODEL, "input": "next", "previous_response_id": rid}
        )
        assert r.json()["pod"] == pod
        assert r.json()["detail"] == {"affinity": "owner"}


# -- the conversion rules (unit) ---------------------------------------------------------------


def test_plain_inputs_convert_to_the_messages_vllm_renders() -> None:
    form = to_chat({"instructions": "sys", "input": "hi"})
    assert form.messages == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "hi"},
    ]
    assert form.tools is None
    # an empty instructions string adds no system message; an empty tools list no tools
    assert to_chat({"instructions": "", "input": "hi", "tools": []}).messages == [
        {"role": "user", "content": "hi"}
    ]
    # vLLM keeps only the first text of an assistant message's parts
    parts = [{"type": "output_text", "text": "one"}, {"type": "output_text", "text": "two"}]
    form = to_chat({"input": [{"type": "message", "role": "assistant", "content": parts}]})
    assert form.messages == [{"role": "assistant", "content": "one"}]


@pytest.mark.parametrize(
    "body,reason",
    [
        (
            {"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]},
            "function_call_output",
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, "reasoning"),
        (
            {
                "input": [
                    {
                        "role": "user",
                        "content": [{"type": "input_image", "image_url": "data:..."}],
                    }
                ]
            },
            "content_part",
        ),
        ({"input": "x", "tools": [{"type": "web_search_preview"}]}, "tools"),
        ({"input": "x", "reasoning": {"effort": "low"}}, "reasoning"),
        ({"input": "x", "previous_input_messages": []}, "previous_input_messages"),
        (
            {"input": [{"role": "assistant", "content": "par", "status": "incomplete"}]},
            "assistant_item",
        ),
        ({"input": [{"role": "user", "content": "x", "name": "bob"}]}, "message_fields"),
        # vLLM rejects parts in an assistant item that does not say type "message"
        (
            {"input": [{"role": "assistant", "content": [{"type": "output_text", "text": "a"}]}]},
            "assistant_item",
        ),
        ({"input": []}, "input"),
    ],
)
def test_what_does_not_convert_exactly_is_unscored_with_a_reason(
    body: dict[str, Any], reason: str
) -> None:
    with pytest.raises(Unscored) as caught:
        to_chat(body)
    assert caught.value.reason == reason


def test_the_response_id_is_found_in_a_body_or_in_the_first_event_however_it_is_split() -> None:
    assert id_from_body(b'{"id": "resp_1", "object": "response"}') == "resp_1"
    assert id_from_body(b"not json") is None
    stream = (
        b'event: response.created\ndata: {"type":"response.created","sequence_number":0,'
        b'"response":{"id":"resp_abc","status":"in_progress"}}\n\n'
        b'event: response.in_progress\ndata: {"type":"response.in_progress"}\n\n'
    )
    for size in (1, 7, len(stream)):
        sniff = CreatedSniffer()
        found = [
            rid
            for i in range(0, len(stream), size)
            if (rid := sniff.feed(stream[i : i + size])) is not None
        ]
        assert found == ["resp_abc"]
        assert sniff.done
    other = CreatedSniffer()
    assert other.feed(b'event: error\ndata: {"type":"error"}\n\n') is None
    assert other.done  # the first event was not response.created: stop looking


async def test_the_memory_owner_store_is_a_bounded_lru_whose_entries_expire(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    clock = [1000.0]
    monkeypatch.setattr("router.decision.owners.time.monotonic", lambda: clock[0])
    store = MemoryOwnerStore(max_owners=2, ttl_s=60)
    await store.put("a", "p0")
    await store.put("b", "p1")
    assert await store.get("a") == "p0"  # a is now the most recently used
    await store.put("c", "p2")
    assert await store.get("b") is None and len(store) == 2
    clock[0] += 61
    assert await store.get("a") is None and await store.get("c") is None
