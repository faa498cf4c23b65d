"""DNS discovery from several sources (router/fleet/dns.py): a prefill service and a
decode service for one model give their addresses their roles; a failing source keeps
its last addresses; one address under two sources is one pod with both sources' models.

Real lookups of loopback names (``127.0.0.1`` resolves to itself, ``localhost`` to the
loopback addresses); the end-to-end test runs simulated pods and the router over real
HTTP and ZMQ, discovered through two DNS sources."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from router.config import FleetSettings, Settings
from router.fleet.discovery import DiscoverySettings, build_discovery
from router.fleet.dns import DnsDiscovery, DnsDiscoverySettings
from router.fleet.embedded import sim_settings, start_pods, stop_pods
from router.fleet.pods import PodRegistry
from router.proxy.app import create_app
from router.proxy.serve import RunningServer
from tests.router.test_pd_proxy import DOC, MODEL, chat
from tests.support.aio import wait_until


def source(hostname: str, port: int, **kw: Any) -> DnsDiscoverySettings:
    return DnsDiscoverySettings(hostname=hostname, port=port, interval_s=0.01, **kw)


def test_dns_discovery_takes_dns_sources_alone_or_after_dns() -> None:
    only = DiscoverySettings.model_validate(
        {
            "kind": "dns",
            "dns_sources": [
                {"hostname": "vllm-prefill", "role": "prefill"},
                {"hostname": "vllm-decode", "role": "decode"},
            ],
        }
    )
    assert [s.role for s in only.all_dns_sources()] == ["prefill", "decode"]
    both = DiscoverySettings.model_validate(
        {"kind": "dns", "dns": {"hostname": "a"}, "dns_sources": [{"hostname": "b"}]}
    )
    assert [s.hostname for s in both.all_dns_sources()] == ["a", "b"]
    assert isinstance(build_discovery(both), DnsDiscovery)


def test_a_dns_source_listed_twice_or_none_at_all_fails_the_settings() -> None:
    with pytest.raises(ValidationError, match=r"DNS sources listed twice: \['a:8000'\]"):
        DiscoverySettings.model_validate(
            {"kind": "dns", "dns": {"hostname": "a"}, "dns_sources": [{"hostname": "a"}]}
        )
    with pytest.raises(ValidationError, match=r"discovery\.dns is not set"):
        DiscoverySettings.model_validate({"kind": "dns", "dns_sources": []})
    with pytest.raises(ValidationError, match="'decoder' is not a pod role"):
        DiscoverySettings.model_validate(
            {"kind": "dns", "dns_sources": [{"hostname": "a", "role": "decoder"}]}
        )


async def test_a_prefill_source_and_a_decode_source_give_their_addresses_their_roles() -> None:
    disc = DnsDiscovery(
        [
            source("127.0.0.1", 8123, role="prefill", models=[MODEL]),
            source("127.0.0.1", 8124, role="decode", models=[MODEL]),
        ]
    )
    reg = PodRegistry()
    task = asyncio.create_task(disc.run(reg))
    try:
        await wait_until(lambda: len(reg.all()) == 2)
    finally:
        task.cancel()
    roles = {p.name: p.role_for(MODEL) for p in reg.all()}
    assert roles == {"127.0.0.1:8123": "prefill", "127.0.0.1:8124": "decode"}
    assert [p.name for p in reg.candidates_for_role(MODEL, "prefill", "both")] == ["127.0.0.1:8123"]


async def test_a_source_that_stops_resolving_keeps_its_last_addresses() -> None:
    good, other = source("127.0.0.1", 8123, role="prefill"), source("127.0.0.1", 8124)
    disc = DnsDiscovery([good, other])
    assert {s.name for s in await disc.refresh()} == {"127.0.0.1:8123", "127.0.0.1:8124"}
    disc.sources[1] = source("no-such-host.invalid", 8124)
    kept = await disc.refresh()
    assert {s.name for s in kept} == {"127.0.0.1:8123", "127.0.0.1:8124"}
    assert disc.failures == 1
    # a source that never resolved contributes nothing; the others still do
    fresh = DnsDiscovery([good, source("no-such-host.invalid", 8124)])
    assert [s.name for s in await fresh.refresh()] == ["127.0.0.1:8123"]


async def test_one_address_under_two_sources_is_one_pod_with_each_sources_model_role() -> None:
    disc = DnsDiscovery(
        [
            source("127.0.0.1", 8123, models=["a"], role="prefill"),
            source("localhost", 8123, models=["b"], role="decode"),
        ]
    )
    specs = {s.name: s for s in await disc.refresh()}
    pod = specs["127.0.0.1:8123"]
    assert pod.models == ("a", "b")
    assert (pod.role_for("a"), pod.role_for("b")) == ("prefill", "decode")
    assert disc.conflicts == 0


async def test_two_roles_for_one_model_at_one_address_keep_the_first_and_count_once() -> None:
    disc = DnsDiscovery(
        [
            source("127.0.0.1", 8123, models=["m"], role="prefill"),
            source("localhost", 8123, models=["m"], role="decode"),
        ]
    )
    for _ in range(3):
        specs = {s.name: s for s in await disc.refresh()}
    assert specs["127.0.0.1:8123"].role_for("m") == "prefill"
    assert disc.conflicts == 1 and disc.conflicting == {("127.0.0.1:8123", "m")}


async def test_a_pd_fleet_discovered_from_two_dns_sources_splits_a_long_prompt() -> None:
    fleet = FleetSettings(pods=0, prefill_pods=1, decode_pods=1)
    configs = [sim_settings(fleet, i, time_scale=1.0) for i in range(2)]
    pods = await start_pods(configs)
    try:

        def dns(pod: Any) -> dict[str, Any]:
            return {
                "hostname": "127.0.0.1",
                "port": httpx.URL(pod.url).port,
                "events_port": int(pod.events_endpoint.rsplit(":", 1)[1]),
                "models": [MODEL],
                "role": pod.settings.role,
                "interval_s": 0.05,
            }

        settings = Settings.model_validate(
            {
                "discovery": {"kind": "dns", "dns_sources": [dns(p) for p in pods]},
                "fleet": {"enabled": False},
                "health": {"enabled": False},
            }
        )
        app = create_app(settings)
        async with (
            RunningServer(app) as server,
            httpx.AsyncClient(base_url=server.url, timeout=30.0) as client,
        ):
            gateway = app.state.gateway
            await wait_until(lambda: len(gateway.registry.candidates(MODEL)) == 2)
            r = await client.post("/v1/chat/completions", json=chat(DOC))
            assert r.status_code == 200, r.text
            prefill, decode = (f"127.0.0.1:{httpx.URL(p.url).port}" for p in pods)
            assert (r.headers["x-kvroute-prefill-pod"], r.headers["x-kvroute-pod"]) == (
                prefill,
                decode,
            )
    finally:
        await stop_pods(pods)
