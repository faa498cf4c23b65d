"""The simulated vLLM pod, spoken to as the router speaks to a real one.

Real HTTP over 127.0.0.1 (httpx), real ZMQ SUB / DEALER sockets, events decoded with
plain msgspec (and with scoring.events' decoder).  Delays are off (time_scale=0)
except where a test needs requests to stay in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import msgspec
import pytest
import zmq
import zmq.asyncio

from router.sim import SimPod, SimSettings
from router.sim.engine import SimEngine, SimRequest
from router.sim.events import END_SEQ
from router.tokenize import ByteTokenizer
from scoring.blocks import BlockHasher

MakePod = Callable[..., Awaitable[SimPod]]
GUARD = 10.0  # seconds: a failure guard for receives, never a speed assertion


@pytest.fixture
async def make_pod() -> AsyncIterator[MakePod]:
    pods: list[SimPod] = []

    async def make(**kw: Any) -> SimPod:
        kw.setdefault("time_scale", 0)
        pod = SimPod(SimSettings(**kw))
        await pod.start()
        pods.append(pod)
        return pod

    yield make
    for pod in pods:
        await pod.stop()


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=GUARD) as client:
        yield client


class Sub:
    """A SUB socket and the batches it receives, decoded with plain msgspec."""

    def __init__(self, sock: zmq.asyncio.Socket) -> None:
        self.sock = sock

    async def recv(self) -> tuple[bytes, int, list[Any]]:
        topic, seq, payload = await asyncio.wait_for(self.sock.recv_multipart(), GUARD)
        return topic, int.from_bytes(seq, "big"), msgspec.msgpack.decode(payload)

    async def events(self) -> list[Any]:
        """The events of the next batch."""
        _, _, batch = await self.recv()
        return list(batch[1])

    async def sync(self, pod: SimPod) -> None:
        """Wait until the subscription is live (PUB drops messages before that):
        publish AllBlocksCleared probes until one arrives, then drain the rest."""
        assert pod.publisher is not None
        while True:
            pod.reset_prefix_cache()
            with contextlib.suppress(TimeoutError):
                _, seq, _ = await asyncio.wait_for(self.recv(), 0.1)
                break
        last = pod.publisher.next_seq - 1
        while seq < last:
            _, seq, _ = await self.recv()


@pytest.fixture
async def subscribe() -> AsyncIterator[Callable[[SimPod], Awaitable[Sub]]]:
    ctx = zmq.asyncio.Context.instance()
    socks: list[zmq.asyncio.Socket] = []

    async def make(pod: SimPod) -> Sub:
        assert pod.events_endpoint is not None
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.connect(pod.events_endpoint)
        socks.append(sock)
        sub = Sub(sock)
        await sub.sync(pod)
        return sub

    yield make
    for s in socks:
        s.close(linger=0)


async def until(cond: Callable[[], bool]) -> None:
    """Poll for a state (not a speed): fail only if it never comes within GUARD."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + GUARD
    while not cond():
        assert loop.time() < deadline, "state not reached"
        await asyncio.sleep(0.01)


def chat_body(text: str, **kw: Any) -> dict[str, Any]:
    return {"model": "sim-model", "messages": [{"role": "user", "content": text}], **kw}


LONG = "Tell me everything about the prefix cache of a vLLM engine. " * 3  # 180 bytes


async def tokenize(http: httpx.AsyncClient, pod: SimPod, body: dict[str, Any]) -> list[int]:
    r = await http.post(f"{pod.url}/tokenize", json=body)
    assert r.status_code == 200, r.text
    return list(r.json()["tokens"])


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample in a Prometheus exposition."""
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        sample, _, rest = head.partition("{")
        if sample != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            return float(value)
    raise AssertionError(f"{name} {labels} not in metrics")


# -- OpenAI API ----------------------------------------------------------------------


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


# -- KV events -----------------------------------------------------------------------


async def test_block_stored_in_map_encoding_has_vllm_fields_and_omits_defaults(
    make_pod: MakePod, http: httpx.AsyncClient, subscribe: Callable[[SimPod], Awaitable[Sub]]
) -> None:
    pod = await make_pod(pod_name="p1", model="m", block_size=16)
    sub = await subscribe(pod)
    body = chat_body(LONG) | {"model": "m", "max_tokens": 1}
    prompt = await tokenize(http, pod, body)
    r = await http.post(f"{pod.url}/v1/chat/completions", json=body)
    assert r.status_code == 200
    topic, seq, batch = await sub.recv()
    assert topic == b"kv@p1@m"
    assert seq == pod.publisher.next_seq - 1  # type: ignore[union-attr]
    ts, events, dp_rank = batch
    assert isinstance(ts, float) and dp_rank == 0
    (ev,) = events
    n = len(prompt) // 16
    assert ev == {
        "type": "BlockStored",
        "block_hashes": ev["block_hashes"],
        "parent_block_hash": None,
        "token_ids": prompt[: n * 16],  # full blocks only, exactly what /tokenize returns
        "block_size": 16,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [None] * n,
        "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }  # the exact key set a vLLM 0.32 CPU engine publishes
    assert len(ev["block_hashes"]) == n
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in ev["block_hashes"])
    assert len(set(ev["block_hashes"])) == n


async def test_array_encoding_is_positional_tag_first_in_vllm_field_order(
    make_pod: MakePod, http: httpx.AsyncClient, subscribe: Callable[[SimPod], Awaitable[Sub]]
) -> None:
    pod = await make_pod(encoding="array", block_size=16, capacity_tokens=16 * 20)
    sub = await subscribe(pod)
    body = chat_body(LONG, max_tokens=1)
    prompt = await tokenize(http, pod, body)
    await http.post(f"{pod.url}/v1/chat/completions", json=body)
    (ev,) = await sub.events()
    n = len(prompt) // 16
    tag, hashes, parent, token_ids, block_size, lora_id, medium, lora_name, extra, group, kind = ev[
        :11
    ]
    assert (tag, parent, token_ids, block_size, lora_id, medium, lora_name, extra, group, kind) == (
        "BlockStored", None, prompt[: n * 16], 16, None, "GPU", None, [None] * n, 0,
        "full_attention",
    )  # fmt: skip
    assert len(hashes) == n
    # a different prompt evicts (cache holds 20 blocks): BlockRemoved is positional too
    await http.post(f"{pod.url}/v1/chat/completions", json=chat_body(LONG.upper(), max_tokens=1))
    events = await sub.events()
    removed = [e for e in events if e[0] == "BlockRemoved"]
    assert removed and all(e[2] == "GPU" and len(e[1]) == 1 for e in removed)
    pod.reset_prefix_cache()
    assert await sub.events() == [["AllBlocksCleared"]]


async def test_cache_hit_emits_only_new_blocks_and_counts_hit_tokens(
    make_pod: MakePod, http: httpx.AsyncClient, subscribe: Callable[[SimPod], Awaitable[Sub]]
) -> None:
    pod = await make_pod(block_size=16)
    sub = await subscribe(pod)
    url = f"{pod.url}/v1/completions"
    base = "x" * 95  # BOS + 95 bytes = 96 tokens = 6 full blocks
    first = (await http.post(url, json={"prompt": base, "max_tokens": 1})).json()
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    (stored,) = await sub.events()
    assert len(stored["block_hashes"]) == 6
    m0 = (await http.get(f"{pod.url}/metrics")).text
    assert metric(m0, "vllm:prefix_cache_queries_total", model_name="sim-model", engine="0") == 96
    assert metric(m0, "vllm:prefix_cache_hits_total") == 0

    second = (await http.post(url, json={"prompt": base + "y" * 40, "max_tokens": 1})).json()
    # 136 tokens: the 6 cached blocks hit (96 tokens); blocks 7 and 8 are new
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 96
    (ev,) = await sub.events()
    assert ev["parent_block_hash"] == stored["block_hashes"][-1]
    assert len(ev["block_hashes"]) == 2
    assert ev["token_ids"] == ByteTokenizer().encode_prompt(base + "y" * 40)[96:128]
    m1 = (await http.get(f"{pod.url}/metrics")).text
    assert metric(m1, "vllm:prefix_cache_queries_total") == 96 + 136
    assert metric(m1, "vllm:prefix_cache_hits_total") == 96

    # a repeated prompt that ends mid-block is served from cache and publishes nothing
    again = (await http.post(url, json={"prompt": base + "y" * 40, "max_tokens": 1})).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 128
    # vLLM always recomputes the last prompt token: a block-aligned prompt hits one
    # block less, recomputes it and publishes it again (a second copy of that hash)
    third = (await http.post(url, json={"prompt": base, "max_tokens": 1})).json()
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == 80
    (restored,) = await sub.events()
    assert restored["block_hashes"] == stored["block_hashes"][-1:]
    assert restored["parent_block_hash"] == stored["block_hashes"][-2]
    assert restored["token_ids"] == ByteTokenizer().encode_prompt(base)[80:96]
    pod.reset_prefix_cache()
    assert await sub.events() == [{"type": "AllBlocksCleared"}]


async def test_generated_tokens_are_stored_as_blocks_when_the_request_ends(
    make_pod: MakePod, http: httpx.AsyncClient, subscribe: Callable[[SimPod], Awaitable[Sub]]
) -> None:
    pod = await make_pod(block_size=16)
    sub = await subscribe(pod)
    prompt = ByteTokenizer().encode_prompt("z" * 39)  # 40 tokens: 2 full blocks + 8
    r = await http.post(f"{pod.url}/v1/completions", json={"prompt": prompt, "max_tokens": 30})
    out = [ord(c) for c in r.json()["choices"][0]["text"]]
    (at_prefill,) = await sub.events()
    (at_end,) = await sub.events()
    assert len(at_prefill["block_hashes"]) == 2
    # 40 + 30 - 1 computed tokens (the last sampled token has no KV) = 4 full blocks
    assert at_end["parent_block_hash"] == at_prefill["block_hashes"][-1]
    assert at_end["token_ids"] == (prompt + out)[32:64]
    assert len(at_end["block_hashes"]) == 2
    # a multi-turn follow-up that contains the answer hits the generated blocks
    follow = (
        await http.post(
            f"{pod.url}/v1/completions", json={"prompt": prompt + out + [1, 2], "max_tokens": 1}
        )
    ).json()
    assert follow["usage"]["prompt_tokens_details"]["cached_tokens"] == 64


async def test_eviction_emits_one_block_removed_per_hash_oldest_first(
    make_pod: MakePod, http: httpx.AsyncClient, subscribe: Callable[[SimPod], Awaitable[Sub]]
) -> None:
    pod = await make_pod(block_size=16, capacity_tokens=16 * 8)
    sub = await subscribe(pod)
    url = f"{pod.url}/v1/completions"
    await http.post(url, json={"prompt": "a" * 95, "max_tokens": 1})  # 6 blocks
    (first,) = await sub.events()
    await http.post(url, json={"prompt": "b" * 63, "max_tokens": 1})  # 4 blocks: 2 must go
    events = await sub.events()
    removed = [e for e in events if e["type"] == "BlockRemoved"]
    stored = [e for e in events if e["type"] == "BlockStored"]
    assert events.index(stored[0]) > events.index(removed[-1])  # room first, then store
    assert [e["block_hashes"] for e in removed] == [[h] for h in first["block_hashes"][::-1][:2]]
    assert all(e["medium"] == "GPU" and e["group_idx"] == 0 for e in removed)
    assert len(stored[0]["block_hashes"]) == 4
    assert len(pod.engine.cache) == 8


async def test_a_hash_stored_twice_is_removed_twice_on_eviction(
    make_pod: MakePod, http: httpx.AsyncClient, subscribe: Callable[[SimPod], Awaitable[Sub]]
) -> None:
    pod = await make_pod(block_size=16, capacity_tokens=16 * 8)
    sub = await subscribe(pod)
    url = f"{pod.url}/v1/completions"
    for _ in range(2):  # block-aligned: the second run re-stores block 6
        await http.post(url, json={"prompt": "a" * 95, "max_tokens": 1})
    (first,) = await sub.events()
    (again,) = await sub.events()
    last = first["block_hashes"][-1]
    assert again["block_hashes"] == [last]
    await http.post(url, json={"prompt": "b" * 127, "max_tokens": 1})  # 8 blocks: all "a" go
    events = await sub.events()
    removed = [e["block_hashes"][0] for e in events if e["type"] == "BlockRemoved"]
    assert sorted(removed, key=str) == sorted([*first["block_hashes"], last], key=str)
    stores = {h: 0 for h in first["block_hashes"]}
    for e in (first, again):
        for h in e["block_hashes"]:
            stores[h] += 1
    assert all(removed.count(h) == n for h, n in stores.items())  # stores - removals = 0


async def test_reset_prefix_cache_endpoint_emits_all_blocks_cleared_and_forgets(
    make_pod: MakePod, http: httpx.AsyncClient, subscribe: Callable[[SimPod], Awaitable[Sub]]
) -> None:
    pod = await make_pod(block_size=16)
    sub = await subscribe(pod)
    url = f"{pod.url}/v1/completions"
    await http.post(url, json={"prompt": "q" * 63, "max_tokens": 1})
    await sub.events()
    r = await http.post(f"{pod.url}/reset_prefix_cache")
    assert r.status_code == 200 and r.json() == {"success": True}
    assert await sub.events() == [{"type": "AllBlocksCleared"}]
    again = (await http.post(url, json={"prompt": "q" * 63, "max_tokens": 1})).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_replay_returns_buffered_batches_from_start_seq_then_vllm_end_frame(
    make_pod: MakePod, http: httpx.AsyncClient
) -> None:
    pod = await make_pod(block_size=16, replay_buffer=3)
    assert pod.replay_endpoint_url is not None
    for i in range(4):  # seq 0..3; the buffer keeps the last 3
        await http.post(f"{pod.url}/v1/completions", json={"prompt": str(i) * 40, "max_tokens": 1})
    assert pod.publisher is not None and pod.publisher.next_seq == 4
    dealer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(pod.replay_endpoint_url)
    try:

        async def replay(start: int) -> list[list[bytes]]:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            frames = []
            while True:
                f = await asyncio.wait_for(dealer.recv_multipart(), GUARD)
                frames.append(f)
                if f[2] == END_SEQ:
                    return frames

        frames = await replay(2)
        assert [int.from_bytes(f[2], "big") for f in frames[:-1]] == [2, 3]
        assert all(f[0] == b"" and f[1] == b"kv@sim-0@sim-model" for f in frames[:-1])
        batch = msgspec.msgpack.decode(frames[0][3])
        assert batch[1][0]["type"] == "BlockStored"
        assert frames[-1] == [b"", b"", (-1).to_bytes(8, "big", signed=True), b""]
        old = await replay(0)  # seq 0 fell out of the buffer
        assert [int.from_bytes(f[2], "big") for f in old[:-1]] == [1, 2, 3]
        # a malformed request is counted and ignored; the socket keeps serving
        await dealer.send_multipart([b"", b"\x00\x01"])
        assert [int.from_bytes(f[2], "big") for f in (await replay(3))[:-1]] == [3]
        assert pod.publisher.bad_replay_requests == 1
    finally:
        dealer.close(linger=0)


async def test_connect_mode_pub_dials_a_subscriber_bound_socket(
    make_pod: MakePod, http: httpx.AsyncClient
) -> None:
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        pods = [
            await make_pod(pod_name=f"c{i}", kv_endpoint=f"tcp://127.0.0.1:{port}")
            for i in range(2)
        ]
        sub = Sub(sock)
        for pod in pods:
            assert pod.events_endpoint is None  # nothing to dial: the pod connected out
            await sub.sync(pod)
        await http.post(f"{pods[1].url}/v1/completions", json={"prompt": "k" * 40})
        topic, _, batch = await sub.recv()
        assert topic == b"kv@c1@sim-model"
        assert batch[1][0]["type"] == "BlockStored"
    finally:
        sock.close(linger=0)


async def test_a_wildcard_endpoint_binds_and_reports_a_loopback_address_to_dial(
    make_pod: MakePod, http: httpx.AsyncClient, subscribe: Callable[[SimPod], Awaitable[Sub]]
) -> None:
    pod = await make_pod(kv_endpoint="tcp://*:0", replay_endpoint="tcp://*:0")
    assert pod.events_endpoint is not None and pod.replay_endpoint_url is not None
    assert pod.events_endpoint.startswith("tcp://127.0.0.1:")
    assert pod.replay_endpoint_url.startswith("tcp://127.0.0.1:")
    sub = await subscribe(pod)
    await http.post(f"{pod.url}/v1/completions", json={"prompt": "u" * 40, "max_tokens": 1})
    assert (await sub.events())[0]["type"] == "BlockStored"


async def test_a_taken_http_port_fails_start_and_closes_the_event_sockets(
    make_pod: MakePod,
) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        pod = SimPod(SimSettings(port=taken.getsockname()[1], time_scale=0))
        with pytest.raises(OSError):
            await pod.start()
        assert pod.publisher is not None and pod.publisher._pub is None
        # the event port is free again: a second pod can take the same endpoint
        assert pod.publisher.endpoint is not None
        port = pod.publisher.endpoint.rsplit(":", 1)[1]
        again = await make_pod(kv_endpoint=f"tcp://*:{port}")  # '*': bind, as vLLM does
        assert again.events_endpoint == pod.publisher.endpoint
    finally:
        taken.close()


async def test_bytes_hashes_are_32_byte_digests(
    make_pod: MakePod, http: httpx.AsyncClient, subscribe: Callable[[SimPod], Awaitable[Sub]]
) -> None:
    pod = await make_pod(int_hashes=False, block_size=16)
    sub = await subscribe(pod)
    await http.post(f"{pod.url}/v1/completions", json={"prompt": "w" * 40, "max_tokens": 1})
    (ev,) = await sub.events()
    assert [type(h) for h in ev["block_hashes"]] == [bytes, bytes]
    assert all(len(h) == 32 for h in ev["block_hashes"])


async def test_lora_and_cache_salt_reach_events_as_vllm_publishes_them(
    make_pod: MakePod, http: httpx.AsyncClient, subscribe: Callable[[SimPod], Awaitable[Sub]]
) -> None:
    pod = await make_pod(block_size=16, lora_adapters=["sql", "chat"])
    sub = await subscribe(pod)
    url = f"{pod.url}/v1/completions"
    prompt = "s" * 47  # 3 blocks
    await http.post(url, json={"model": "chat", "prompt": prompt, "max_tokens": 1})
    (lora_ev,) = await sub.events()
    assert (lora_ev["lora_name"], lora_ev["lora_id"]) == ("chat", 2)
    assert lora_ev["extra_keys"] == [["chat"]] * 3
    await http.post(url, json={"prompt": prompt, "max_tokens": 1, "cache_salt": "tenant-a"})
    (salted,) = await sub.events()
    assert salted["extra_keys"] == [["tenant-a"], None, None]
    assert "lora_name" in salted and salted["lora_name"] is None
    await http.post(
        url, json={"model": "sql", "prompt": prompt, "cache_salt": "t", "max_tokens": 1}
    )
    (both,) = await sub.events()
    assert both["extra_keys"] == [["sql", "t"], ["sql"], ["sql"]]
    # LoRA and salt change every hash: four distinct chains, no hits between them
    await http.post(url, json={"prompt": prompt, "max_tokens": 1})
    (plain,) = await sub.events()
    chains = [tuple(e["block_hashes"]) for e in (lora_ev, salted, both, plain)]
    assert len({h for c in chains for h in c}) == 12


async def test_engine_hashes_are_not_the_router_block_keys(
    make_pod: MakePod, http: httpx.AsyncClient, subscribe: Callable[[SimPod], Awaitable[Sub]]
) -> None:
    pod = await make_pod(model="sim-model", block_size=16)
    sub = await subscribe(pod)
    await http.post(f"{pod.url}/v1/completions", json={"prompt": "r" * 47, "max_tokens": 1})
    (ev,) = await sub.events()
    ours = BlockHasher(16, "sim-model").keys(ev["token_ids"])
    assert len(ours) == len(ev["block_hashes"])
    assert not set(ours) & set(ev["block_hashes"])


async def test_sha256_mode_reproduces_vllm_hash_and_sim_mode_does_not(
    make_pod: MakePod, http: httpx.AsyncClient, subscribe: Callable[[SimPod], Awaitable[Sub]]
) -> None:
    from scoring.events.engine_hash import EngineHasher as VllmHash

    vllm = VllmHash("sha256", "vllm-none-hash", lora_paths={"l": "/sim/lora/l"})
    body = {"model": "l", "prompt": "h" * 47, "cache_salt": "s", "max_tokens": 1}
    prompt = ByteTokenizer().encode_prompt("h" * 47)
    expected = [vllm.published(d) for d in vllm.chain(prompt, 16, lora="l", cache_salt="s")]
    for algo in ("sha256", "sim"):
        pod = await make_pod(block_size=16, hash_algo=algo, lora_adapters=["l"])
        sub = await subscribe(pod)
        await http.post(f"{pod.url}/v1/completions", json=body)
        (ev,) = await sub.events()
        if algo == "sha256":
            assert ev["block_hashes"] == expected
        else:
            assert not set(ev["block_hashes"]) & set(expected)
    models = (await http.get(f"{pod.url}/v1/models")).json()["data"]
    assert models[1]["root"] == "/sim/lora/l"  # where an engine-hash mode finds the path


async def test_scoring_decoder_reads_the_sim_events_in_both_encodings(
    make_pod: MakePod, http: httpx.AsyncClient
) -> None:
    from scoring.events import decode

    for encoding in ("map", "array"):
        pod = await make_pod(
            encoding=encoding, block_size=16, capacity_tokens=64, lora_adapters=["l"]
        )
        url = f"{pod.url}/v1/completions"
        await http.post(
            url, json={"model": "l", "prompt": "d" * 47, "cache_salt": "s", "max_tokens": 1}
        )
        await http.post(url, json={"prompt": "e" * 47, "max_tokens": 1})  # evicts
        pod.reset_prefix_cache()
        assert pod.publisher is not None
        dealer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(pod.replay_endpoint_url)  # type: ignore[arg-type]
        try:
            await dealer.send_multipart([b"", (0).to_bytes(8, "big")])
            decoded, seqs = [], []
            while True:
                f = await asyncio.wait_for(dealer.recv_multipart(), GUARD)
                if f[2] == END_SEQ:
                    break
                seqs.append(int.from_bytes(f[2], "big"))
                decoded.append(decode.decode_batch(f[3]))
        finally:
            dealer.close(linger=0)
        assert seqs == list(range(len(seqs)))  # seq counts from 0 per engine process
        events = [e for b in decoded for e in b.events]
        assert all(not b.errors and b.unknown == 0 for b in decoded), encoding
        first, last = events[0], events[-1]
        assert any(isinstance(e, decode.BlockRemoved) for e in events)
        assert isinstance(last, decode.AllBlocksCleared)
        assert isinstance(first, decode.BlockStored) and first.extra_keys is not None
        assert first.lora_name == "l" and first.extra_keys[0] == ["l", "s"]
        assert first.token_ids == ByteTokenizer().encode_prompt("d" * 47)[:48]
        assert first.medium == "GPU" and first.block_size == 16


# -- metrics and the time model --------------------------------------------------------


async def test_metrics_expose_vllm_names_labels_and_cache_config_info(
    make_pod: MakePod, http: httpx.AsyncClient
) -> None:
    pod = await make_pod(model="m", block_size=32, capacity_tokens=32 * 100)
    await http.post(f"{pod.url}/v1/completions", json={"model": "m", "prompt": "t" * 70})
    text = (await http.get(f"{pod.url}/metrics")).text
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
    ):
        assert metric(text, name, model_name="m", engine="0") == 0
    assert metric(text, "vllm:time_to_first_token_seconds_count", model_name="m", engine="0") == 1
    assert metric(text, "vllm:request_queue_time_seconds_count", model_name="m", engine="0") == 1
    assert metric(text, "vllm:prefix_cache_queries_total", model_name="m") == 71
    assert metric(text, "vllm:request_success_total", finished_reason="length") == 1
    assert 'le="0.001"' in text and 'le="2560.0"' in text  # vLLM's TTFT buckets
    info = metric(
        text,
        "vllm:cache_config_info",
        block_size="32",
        num_gpu_blocks="100",
        kv_cache_size_tokens="3200",
        enable_prefix_caching="True",
        prefix_caching_hash_algo="sha256",
        engine="0",
    )
    assert info == 1
    # each pod has its own registry
    other = await make_pod(model="m2")
    assert "vllm:prefix_cache_queries_total" in (await http.get(f"{other.url}/metrics")).text
    assert 'model_name="m"' not in (await http.get(f"{other.url}/metrics")).text


async def test_waiting_and_running_and_kv_usage_follow_requests_in_flight(
    make_pod: MakePod, http: httpx.AsyncClient
) -> None:
    # prefill of ~64 tokens at 1 token/s: requests stay in flight until cancelled
    pod = await make_pod(time_scale=1.0, prefill_rate=1.0, block_size=16, capacity_tokens=16 * 40)
    url = f"{pod.url}/v1/completions"
    tasks = [
        asyncio.create_task(http.post(url, json={"prompt": c * 63, "max_tokens": 1})) for c in "abc"
    ]

    async def gauges() -> tuple[float, float, float]:
        text = (await http.get(f"{pod.url}/metrics")).text
        return (
            metric(text, "vllm:num_requests_running"),
            metric(text, "vllm:num_requests_waiting"),
            metric(text, "vllm:kv_cache_usage_perc"),
        )

    try:
        await until(lambda: (pod.engine.running, pod.engine.waiting) == (1, 2))
        # the scraped gauges say the same; 64 tokens of the running prompt = 4 of 40 blocks
        assert await gauges() == (1, 2, pytest.approx(4 / 40))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    # client aborts free the slot and the queue places
    await until(lambda: (pod.engine.running, pod.engine.waiting) == (0, 0))
    assert await gauges() == (0, 0, 0)


async def test_a_stream_closed_by_the_client_aborts_and_frees_its_slot(
    make_pod: MakePod, http: httpx.AsyncClient, subscribe: Callable[[SimPod], Awaitable[Sub]]
) -> None:
    # decode at 1 token/s: the stream would last ~100 s unless the abort works
    pod = await make_pod(time_scale=1.0, decode_rate=1.0, block_size=16)
    sub = await subscribe(pod)
    body = {"prompt": "v" * 40, "max_tokens": 100, "stream": True}
    async with http.stream("POST", f"{pod.url}/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                break  # the first token arrived; hang up
    (at_prefill,) = await sub.events()
    assert len(at_prefill["block_hashes"]) == 2
    await until(lambda: pod.engine.running == 0)
    text = (await http.get(f"{pod.url}/metrics")).text
    assert metric(text, "vllm:request_success_total", finished_reason="abort") == 1
    assert metric(text, "vllm:num_requests_running") == 0


async def test_ttft_is_queue_wait_plus_uncached_tokens_over_prefill_rate() -> None:
    """The time model, checked on the simulated delays it asks for (no clock)."""
    slept: list[float] = []

    async def record(seconds: float) -> None:
        slept.append(seconds)
        await asyncio.sleep(0)

    s = SimSettings(block_size=16, prefill_rate=1000.0, decode_rate=50.0, time_scale=2.0)
    engine = SimEngine(s, sleep=record)

    async def run(prompt: list[int], max_tokens: int) -> SimRequest:
        req = engine.prepare(SimRequest(prompt_ids=prompt, max_tokens=max_tokens))
        async for _ in engine.generate(req):
            pass
        return req

    prompt = list(range(100))  # 6 full blocks + 4
    await run(prompt, 3)
    # prefill 100 uncached tokens, then 2 decode steps; all x time_scale 2
    assert slept == [pytest.approx(2 * 100 / 1000), pytest.approx(2 / 50), pytest.approx(2 / 50)]
    slept.clear()
    req = await run(prompt + list(range(100, 120)), 1)
    assert req.cached_tokens == 96
    assert slept == [pytest.approx(2 * (120 - 96) / 1000)]


async def test_a_queue_forms_behind_max_batch_and_drains_in_order() -> None:
    gate = asyncio.Event()

    async def held(seconds: float) -> None:
        await gate.wait()

    engine = SimEngine(SimSettings(max_batch=1, time_scale=1.0), sleep=held)
    order: list[int] = []

    async def run(i: int) -> None:
        req = engine.prepare(SimRequest(prompt_ids=[i] * 20, max_tokens=2))
        async for _ in engine.generate(req):
            pass
        order.append(i)

    tasks = [asyncio.create_task(run(i)) for i in range(3)]
    await until(lambda: engine.waiting == 2)
    assert engine.running == 1
    gate.set()
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2]
    assert (engine.running, engine.waiting) == (0, 0)


# -- the command ---------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_kvroute_sim_serves_until_a_signal_and_exits_cleanly(sig: signal.Signals) -> None:
    cmd = [
        sys.executable, "-m", "router.cli", "sim", "--port", "0", "--model", "cli-m",
        "--pod-name", "cli-p", "--block-size", "32", "--capacity-tokens", "4096",
        "--kv-endpoint", "tcp://127.0.0.1:0", "--replay-endpoint", "tcp://127.0.0.1:0",
        "--encoding", "array", "--time-scale", "0",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline())
        assert info["topic"] == "kv@cli-p@cli-m"
        assert info["events_endpoint"].startswith("tcp://127.0.0.1:")
        with httpx.Client(timeout=GUARD) as c:
            models = c.get(f"{info['url']}/v1/models").json()
            assert models["data"][0]["id"] == "cli-m"
            text = c.get(f"{info['url']}/metrics").text
            assert 'block_size="32"' in text
        proc.send_signal(sig)
        assert proc.wait(timeout=GUARD) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_kvroute_sim_rejects_invalid_settings_with_a_message() -> None:
    from router.sim.main import main

    assert main(["--block-size", "0"]) == 2
