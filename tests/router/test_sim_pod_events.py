"""The simulated vLLM pod's KV events as vLLM publishes them: the encodings, what a cache
hit, a finished request, an eviction and a reset emit, and the replay socket (real ZMQ
SUB / DEALER sockets, events decoded with plain msgspec).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx
import msgspec
import zmq
import zmq.asyncio

from router.sim import SimPod
from router.sim.events import END_SEQ
from router.tokenize import ByteTokenizer
from tests.router.sim_pod_support import GUARD, LONG, MakePod, Sub, chat_body, metric, tokenize
from tests.router.sim_pod_support import http as http  # the fixture
from tests.router.sim_pod_support import make_pod as make_pod  # the fixture
from tests.router.sim_pod_support import subscribe as subscribe  # the fixture


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
