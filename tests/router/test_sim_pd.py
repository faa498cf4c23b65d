# ruff: noqa: F811  (the fixtures imported from sim_pod_support are test parameters here)
"""The simulated pod in P/D roles, over real HTTP on loopback: the prefill pod returns
``kv_transfer_params`` and holds its blocks under a lease, the decode pod pulls them
(charging a transfer per block, publishing BlockStored as vLLM does) and refuses stale
or foreign params per ``kv_load_failure_policy``."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from router.sim import SimPod
from tests.router.sim_pod_support import (  # noqa: F401  (fixtures)
    LONG,
    MakePod,
    chat_body,
    http,
    make_pod,
    metric,
    subscribe,
    until,
)

PROMPT = LONG * 2  # 360 bytes: 22 full blocks of 16 with the builtin tokenizer


def prefill_body(text: str = PROMPT) -> dict[str, Any]:
    """What a P/D proxy sends the prefill pod (vLLM's toy_proxy_server.py)."""
    return chat_body(
        text,
        max_tokens=1,
        stream=False,
        kv_transfer_params={
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    )


async def prefill(http: httpx.AsyncClient, pod: SimPod, rid: str = "req-1") -> dict[str, Any]:
    r = await http.post(
        f"{pod.url}/v1/chat/completions", json=prefill_body(), headers={"X-Request-Id": rid}
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


async def decode(
    http: httpx.AsyncClient, pod: SimPod, params: dict[str, Any] | None, rid: str = "req-1"
) -> httpx.Response:
    body = chat_body(PROMPT, max_tokens=8)
    if params is not None:
        body["kv_transfer_params"] = params
    return await http.post(
        f"{pod.url}/v1/chat/completions", json=body, headers={"X-Request-Id": rid}
    )


class SimClock:
    """Records the simulated delays a pod charges (instead of sleeping them)."""

    def __init__(self, pod: SimPod) -> None:
        self.total = 0.0
        pod.engine._sleeper = self.sleep

    async def sleep(self, seconds: float) -> None:
        self.total += seconds
        await asyncio.sleep(0)


async def test_prefill_pod_returns_params_naming_its_blocks_and_holds_them(
    make_pod: MakePod, http: httpx.AsyncClient
) -> None:
    p = await make_pod(pod_name="p0", role="prefill")
    out = await prefill(http, p)
    params = out["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert params["remote_engine_id"] == "sim-engine-p0"
    assert params["remote_request_id"].startswith("req-1")
    assert (params["remote_host"], params["remote_port"]) == (
        "127.0.0.1",
        int(p.url.rsplit(":", 1)[1]),
    )
    assert params["tp_size"] == 1
    n_blocks = (out["usage"]["prompt_tokens"]) // 16
    assert len(params["remote_block_ids"]) == n_blocks
    assert out["choices"][0]["finish_reason"] == "length"
    text = (await http.get(f"{p.url}/metrics")).text
    assert metric(text, "kvroute_sim_kv_leased_blocks") == n_blocks
    assert metric(text, "vllm:kv_cache_usage_perc") == pytest.approx(n_blocks / 4096)


async def test_a_request_without_params_gets_none_back_and_a_decode_pod_holds_nothing(
    make_pod: MakePod, http: httpx.AsyncClient
) -> None:
    p = await make_pod(pod_name="p0", role="prefill")
    plain = await http.post(f"{p.url}/v1/chat/completions", json=chat_body(PROMPT))
    assert "kv_transfer_params" not in plain.json()
    d = await make_pod(pod_name="d0", role="decode")
    asked = await http.post(f"{d.url}/v1/chat/completions", json=prefill_body())
    assert "kv_transfer_params" not in asked.json()  # a decode-only pod does not hold
    assert d.disagg.leased_blocks == 0


async def test_decode_with_valid_params_pulls_the_blocks_and_charges_less_than_recompute(
    make_pod: MakePod, http: httpx.AsyncClient
) -> None:
    slow = {"time_scale": 1.0, "prefill_rate": 1000.0, "decode_rate": 1e9}
    p = await make_pod(pod_name="p0", role="prefill", **slow)
    d = await make_pod(pod_name="d0", role="decode", kv_transfer_s_per_block=1e-4, **slow)
    recompute = await make_pod(pod_name="d1", role="decode", **slow)
    for pod in (p, d, recompute):
        SimClock(pod)
    clock_d, clock_r = SimClock(d), SimClock(recompute)
    params = (await prefill(http, p))["kv_transfer_params"]
    pulled = await decode(http, d, params)
    local = await decode(http, recompute, None)
    assert pulled.status_code == local.status_code == 200
    n = pulled.json()["usage"]["prompt_tokens"]
    blocks = len(params["remote_block_ids"])
    # recompute: the whole prompt at 1000 tok/s; pull: 22 blocks x 0.1 ms + the tail
    assert clock_r.total == pytest.approx(n / 1000.0)
    assert clock_d.total == pytest.approx(blocks * 1e-4 + (n - blocks * 16) / 1000.0)
    assert clock_d.total < clock_r.total
    assert pulled.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == blocks * 16
    text = (await http.get(f"{d.url}/metrics")).text
    assert metric(text, "kvroute_sim_kv_transfers_total", outcome="ok") == 1
    assert metric(text, "kvroute_sim_kv_pulled_blocks_total") == blocks
    assert metric(text, "vllm:prefix_cache_hits_total") == 0  # pulled blocks are no local hit
    assert p.disagg.leased_blocks == 0  # the read ended the lease


async def test_stale_or_foreign_params_fail_the_request_as_vllms_default_policy(
    make_pod: MakePod, http: httpx.AsyncClient
) -> None:
    p = await make_pod(pod_name="p0", role="prefill")
    d = await make_pod(pod_name="d0", role="decode")
    params = (await prefill(http, p))["kv_transfer_params"]
    assert (await decode(http, d, params)).status_code == 200
    stale = await decode(http, d, params)  # the lease was consumed by the first read
    assert stale.status_code == 500
    assert stale.json()["error"]["type"] == "InternalServerError"
    assert "no lease" in stale.json()["error"]["message"]
    foreign = await decode(http, d, {**params, "remote_engine_id": "someone-else"})
    assert foreign.status_code == 500 and "is not this pod" in foreign.json()["error"]["message"]
    outside = await decode(http, d, {**params, "remote_host": "10.0.0.1"})
    assert outside.status_code == 500 and "kv_peer_hosts" in outside.json()["error"]["message"]
    text = (await http.get(f"{d.url}/metrics")).text
    assert metric(text, "kvroute_sim_kv_transfers_total", outcome="failed") == 3


async def test_with_the_recompute_policy_a_failed_pull_computes_the_prompt_locally(
    make_pod: MakePod, http: httpx.AsyncClient
) -> None:
    p = await make_pod(pod_name="p0", role="prefill")
    d = await make_pod(pod_name="d0", role="decode", kv_load_failure_policy="recompute")
    params = (await prefill(http, p))["kv_transfer_params"]
    p.disagg.release(params["remote_request_id"])  # as if it had expired
    r = await decode(http, d, params)
    assert r.status_code == 200
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_params_missing_a_remote_field_are_ignored_and_the_prompt_computed_locally(
    make_pod: MakePod, http: httpx.AsyncClient
) -> None:
    p = await make_pod(pod_name="p0", role="prefill")
    d = await make_pod(pod_name="d0", role="decode")
    params = (await prefill(http, p))["kv_transfer_params"]
    del params["remote_host"]
    r = await decode(http, d, params)
    assert r.status_code == 200
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    text = (await http.get(f"{d.url}/metrics")).text
    assert metric(text, "kvroute_sim_kv_transfers_total", outcome="invalid_params") == 1


async def test_an_unpulled_lease_expires_and_frees_its_blocks(
    make_pod: MakePod, http: httpx.AsyncClient
) -> None:
    p = await make_pod(pod_name="p0", role="prefill", kv_lease_s=0.05)
    d = await make_pod(pod_name="d0", role="decode")
    params = (await prefill(http, p))["kv_transfer_params"]
    assert p.disagg.leased_blocks > 0
    await until(lambda: p.disagg.leased_blocks == 0)
    text = (await http.get(f"{p.url}/metrics")).text
    assert metric(text, "kvroute_sim_kv_expired_leases_total") == 1
    assert metric(text, "vllm:kv_cache_usage_perc") == 0
    # the blocks stay cached (evictable again): the same prompt hits on the prefill pod
    again = await http.post(f"{p.url}/v1/chat/completions", json=chat_body(PROMPT))
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert (await decode(http, d, params)).status_code == 500


async def test_leased_blocks_are_not_evicted_by_other_prompts(
    make_pod: MakePod, http: httpx.AsyncClient
) -> None:
    p = await make_pod(pod_name="p0", role="prefill", capacity_tokens=640)  # 40 blocks
    params = (await prefill(http, p))["kv_transfer_params"]
    for i in range(4):  # 4 x 22 other blocks through a 40-block cache
        other = chat_body(f"{i} other prompt " * 24)
        assert (await http.post(f"{p.url}/v1/chat/completions", json=other)).status_code == 200
    assert p.engine.cache.match(params["remote_block_ids"]) == len(params["remote_block_ids"])


async def test_a_decode_pod_publishes_block_stored_for_the_blocks_it_pulled(
    make_pod: MakePod, http: httpx.AsyncClient, subscribe: Any
) -> None:
    p = await make_pod(pod_name="p0", role="prefill")
    d = await make_pod(pod_name="d0", role="decode")
    sub = await subscribe(d)
    params = (await prefill(http, p))["kv_transfer_params"]
    r = await decode(http, d, params)
    assert r.status_code == 200
    events = await sub.events()
    stored = [e for e in events if e["type"] == "BlockStored"]
    assert len(stored) == 1
    assert len(stored[0]["block_hashes"]) == len(params["remote_block_ids"])
    assert stored[0].get("parent_block_hash") is None  # the chain starts at token 0
    tokens = (
        await http.post(
            f"{d.url}/tokenize",
            json={"messages": chat_body(PROMPT)["messages"], "add_generation_prompt": True},
        )
    ).json()["tokens"]
    assert stored[0]["token_ids"] == tokens[: 16 * len(params["remote_block_ids"])]


async def test_the_embedded_fleet_starts_prefill_and_decode_pods_that_hand_over_blocks(
    http: httpx.AsyncClient,
) -> None:
    from router.config import FleetSettings
    from router.fleet.embedded import sim_settings, start_pods, static_pods, stop_pods

    fleet = FleetSettings(pods=1, prefill_pods=1, decode_pods=1)
    configs = [sim_settings(fleet, i, time_scale=0) for i in range(3)]
    assert [(c.pod_name, c.role) for c in configs] == [
        ("sim-0", "both"),
        ("sim-p0", "prefill"),
        ("sim-d0", "decode"),
    ]
    pods = await start_pods(configs)
    try:
        assert [s.role for s in static_pods(pods)] == ["both", "prefill", "decode"]
        params = (await prefill(http, pods[1]))["kv_transfer_params"]
        r = await decode(http, pods[2], params)
        assert r.status_code == 200
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    finally:
        await stop_pods(pods)


def test_an_embedded_fleet_needs_at_least_one_pod() -> None:
    from pydantic import ValidationError

    from router.config import FleetSettings

    with pytest.raises(ValidationError, match="at least 1"):
        FleetSettings(pods=0)
