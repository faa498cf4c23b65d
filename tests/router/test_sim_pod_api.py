"""The simulated vLLM pod's OpenAI API, and the errors it answers, over real HTTP on
127.0.0.1 (httpx).
"""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from router.sim import SimSettings
from router.tokenize import ByteTokenizer
from tests.router.sim_pod_support import MakePod, chat_body, metric, tokenize
from tests.router.sim_pod_support import http as http  # the fixture
from tests.router.sim_pod_support import make_pod as make_pod  # the fixture


async def test_models_lists_the_model_and_lora_adapters_in_vllm_shape(
    make_pod: MakePod, http: httpx.AsyncClient
) -> None:
    pod = await make_pod(model="m", lora_adapters=["sql"], max_model_len=4096)
    r = await http.get(f"{pod.url}/v1/models")
    body = r.json()
    assert body["object"] == "list"
    assert [(m["id"], m["object"], m["owned_by"], m["max_model_len"]) for m in body["data"]] == [
        ("m", "model", "vllm", 4096),
        ("sql", "model", "vllm", 4096),
    ]
    assert body["data"][1]["parent"] == "m"
    assert (await http.get(f"{pod.url}/health")).status_code == 200


async def test_chat_completion_answers_deterministic_text_with_usage(
    make_pod: MakePod, http: httpx.AsyncClient
) -> None:
    pod = await make_pod()
    bodies = [
        (
            await http.post(f"{pod.url}/v1/chat/completions", json=chat_body("hi", max_tokens=7))
        ).json()
        for _ in range(2)
    ]
    a, b = bodies
    assert a["object"] == "chat.completion"
    assert a["choices"][0]["message"]["role"] == "assistant"
    text = a["choices"][0]["message"]["content"]
    assert len(text) == 7 and text == b["choices"][0]["message"]["content"]
    assert a["choices"][0]["finish_reason"] == "length"
    prompt = ByteTokenizer().encode_chat([{"role": "user", "content": "hi"}])
    assert a["usage"]["prompt_tokens"] == len(prompt)
    assert a["usage"]["completion_tokens"] == 7
    assert a["usage"]["total_tokens"] == len(prompt) + 7


async def test_chat_streaming_sends_role_chunk_one_chunk_per_token_usage_and_done(
    make_pod: MakePod, http: httpx.AsyncClient
) -> None:
    pod = await make_pod()
    body = chat_body("hi", max_tokens=4, stream=True, stream_options={"include_usage": True})
    async with http.stream("POST", f"{pod.url}/v1/chat/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = (await r.aread()).decode()
    frames = raw.split("\n\n")
    assert frames[-1] == "" and frames[-2] == "data: [DONE]"
    chunks = [json.loads(f.removeprefix("data: ")) for f in frames[:-2]]
    assert all(f.startswith("data: ") for f in frames[:-2])
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    tokens = chunks[1:-1]
    assert len(tokens) == 4
    assert [c["choices"][0]["finish_reason"] for c in tokens] == [None, None, None, "length"]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4
    streamed = "".join(c["choices"][0]["delta"]["content"] for c in tokens)
    plain = await http.post(f"{pod.url}/v1/chat/completions", json=chat_body("hi", max_tokens=4))
    assert streamed == plain.json()["choices"][0]["message"]["content"]


async def test_completion_stream_and_non_stream_agree_and_token_id_prompts_work(
    make_pod: MakePod, http: httpx.AsyncClient
) -> None:
    pod = await make_pod()
    url = f"{pod.url}/v1/completions"
    plain = (await http.post(url, json={"prompt": "hello", "max_tokens": 5})).json()
    assert plain["object"] == "text_completion"
    async with http.stream(
        "POST", url, json={"prompt": "hello", "max_tokens": 5, "stream": True}
    ) as r:
        raw = (await r.aread()).decode()
    chunks = [json.loads(f[6:]) for f in raw.split("\n\n") if f and f != "data: [DONE]"]
    assert "usage" not in chunks[-1]  # no include_usage, no usage chunk
    assert "".join(c["choices"][0]["text"] for c in chunks) == plain["choices"][0]["text"]
    ids = ByteTokenizer().encode_prompt("hello")
    by_ids = (await http.post(url, json={"prompt": ids, "max_tokens": 5})).json()
    assert by_ids["choices"][0]["text"] == plain["choices"][0]["text"]
    assert by_ids["usage"]["prompt_tokens"] == len(ids)


async def test_tokenize_equals_the_builtin_tokenizer_in_vllm_shape(
    make_pod: MakePod, http: httpx.AsyncClient
) -> None:
    pod = await make_pod(max_model_len=1000)
    tok = ByteTokenizer()
    r = (await http.post(f"{pod.url}/tokenize", json={"prompt": "héllo"})).json()
    assert r == {
        "count": len(tok.encode_prompt("héllo")),
        "max_model_len": 1000,
        "tokens": tok.encode_prompt("héllo"),
        "token_strs": None,
    }
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "f"}}]
    for agp in (True, False):
        body = {"messages": messages, "add_generation_prompt": agp, "tools": tools}
        expected = tok.encode_chat(messages, tools=tools, add_generation_prompt=agp)
        assert await tokenize(http, pod, body) == expected


async def test_embeddings_are_deterministic_unit_vectors(
    make_pod: MakePod, http: httpx.AsyncClient
) -> None:
    pod = await make_pod(embedding_dim=8)
    body = {"model": "sim-model", "input": ["a", "b", "a"]}
    r = (await http.post(f"{pod.url}/v1/embeddings", json=body)).json()
    vecs = [d["embedding"] for d in r["data"]]
    assert [d["index"] for d in r["data"]] == [0, 1, 2]
    assert len(vecs[0]) == 8 and vecs[0] == vecs[2] and vecs[0] != vecs[1]
    assert abs(sum(x * x for x in vecs[1]) - 1.0) < 1e-9
    assert r["usage"]["prompt_tokens"] == 3 * len(ByteTokenizer().encode_prompt("a"))


async def test_served_connections_disable_nagle_so_two_part_responses_are_not_delayed(
    make_pod: MakePod, http: httpx.AsyncClient
) -> None:
    """A response goes out as headers then body; with Nagle on, the body waits for the
    client's delayed ACK (~40 ms per POST).  Every accepted socket has TCP_NODELAY."""
    pod = await make_pod()
    assert (await http.post(f"{pod.url}/tokenize", json={"prompt": "hi"})).status_code == 200
    server = pod._server
    assert server is not None
    socks = [c.transport.get_extra_info("socket") for c in server.server_state.connections]
    assert socks
    assert all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in socks)


# -- errors --------------------------------------------------------------------------


async def test_bad_requests_get_openai_error_json_and_are_counted(
    make_pod: MakePod, http: httpx.AsyncClient
) -> None:
    pod = await make_pod(max_model_len=64)
    chat = f"{pod.url}/v1/chat/completions"
    cases = [
        (chat, chat_body("hi") | {"model": "nope"}, 404, "NotFoundError", "model"),
        (chat, chat_body("x" * 100), 400, "BadRequestError", "input_tokens"),
        (chat, chat_body("hi", max_tokens=60), 400, "BadRequestError", "max_tokens"),
        (chat, chat_body("hi", max_tokens="3"), 400, "BadRequestError", "max_tokens"),
        (chat, {"model": "sim-model", "messages": []}, 400, "BadRequestError", "messages"),
        (chat, {"messages": [{"content": "no role"}]}, 400, "BadRequestError", "messages"),
        (chat, chat_body("hi", n=2), 400, "BadRequestError", "n"),
        (f"{pod.url}/v1/completions", {"prompt": [1, -2]}, 400, "BadRequestError", "prompt"),
        (f"{pod.url}/v1/completions", {"max_tokens": 2}, 400, "BadRequestError", "prompt"),
        (f"{pod.url}/tokenize", {"nothing": 1}, 400, "BadRequestError", "prompt"),
        (f"{pod.url}/v1/embeddings", {"input": 5}, 400, "BadRequestError", "input"),
    ]
    for url, body, status, type_, param in cases:
        r = await http.post(url, json=body)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert (err["type"], err["param"], err["code"]) == (type_, param, status), body
        assert err["message"]
    r = await http.post(chat, content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "invalid JSON" in r.json()["error"]["message"]
    r = await http.post(chat, json=[1, 2])
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    text = (await http.get(f"{pod.url}/metrics")).text
    assert metric(text, "kvroute_sim_rejected_requests_total", status="404") == 1
    assert metric(text, "kvroute_sim_rejected_requests_total", status="400") == len(cases) + 1
    # the pod still serves after all that
    ok = await http.post(chat, json=chat_body("hi", max_tokens=2))
    assert ok.status_code == 200


def test_settings_reject_unknown_fields_and_bad_values() -> None:
    with pytest.raises(ValueError, match="bogus"):
        SimSettings(bogus=1)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="capacity_tokens"):
        SimSettings(block_size=32, capacity_tokens=16)
    with pytest.raises(ValueError, match="kv_endpoint"):
        SimSettings(kv_endpoint="localhost:5557")
