"""The block hashes in the simulated vLLM pod's events: bytes digests, LoRA and
cache_salt, sha256 mode reproducing vLLM's hash, and scoring.events' decoder reading them
(real HTTP and ZMQ on 127.0.0.1).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx
import zmq
import zmq.asyncio

from router.sim import SimPod
from router.sim.events import END_SEQ
from router.tokenize import ByteTokenizer
from scoring.blocks import BlockHasher
from tests.router.sim_pod_support import GUARD, MakePod, Sub
from tests.router.sim_pod_support import http as http  # the fixture
from tests.router.sim_pod_support import make_pod as make_pod  # the fixture
from tests.router.sim_pod_support import subscribe as subscribe  # the fixture


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
