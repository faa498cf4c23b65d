"""Pod discovery: its settings, the static list, and DNS re-resolution."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from router.fleet.discovery import (
    DiscoverySettings,
    DnsDiscovery,
    DnsDiscoverySettings,
    StaticDiscovery,
    build_discovery,
)
from router.fleet.pods import PodRegistry
from tests.support.aio import running, wait_until


def test_settings_reject_a_kind_without_its_section() -> None:
    with pytest.raises(ValidationError, match=r"discovery\.dns is not set"):
        DiscoverySettings(kind="dns")
    with pytest.raises(ValidationError, match=r"discovery\.k8s is not set"):
        DiscoverySettings(kind="k8s")


def test_settings_reject_unknown_fields_and_duplicate_static_names() -> None:
    with pytest.raises(ValidationError, match="hostnme"):
        DiscoverySettings.model_validate({"kind": "dns", "dns": {"hostnme": "x"}})
    pod = {"name": "a", "url": "http://127.0.0.1:1"}
    with pytest.raises(ValidationError, match="duplicate pod names"):
        DiscoverySettings.model_validate({"static": [pod, pod]})


# -- static --------------------------------------------------------------------------


async def test_static_discovery_registers_the_configured_pods() -> None:
    settings = DiscoverySettings.model_validate(
        {
            "static": [
                {
                    "name": "p0",
                    "url": "http://127.0.0.1:8001/",
                    "events_endpoint": "tcp://127.0.0.1:5557",
                    "replay_endpoint": "tcp://127.0.0.1:5657",
                    "models": ["m"],
                },
                {"name": "p1", "url": "http://127.0.0.1:8002"},
            ]
        }
    )
    disc = build_discovery(settings)
    assert isinstance(disc, StaticDiscovery)
    reg = PodRegistry()
    await disc.run(reg)
    p0 = reg.get("p0")
    assert p0 is not None
    assert p0.spec.url == "http://127.0.0.1:8001"  # trailing slash dropped
    assert p0.spec.events_endpoint == "tcp://127.0.0.1:5557"
    assert p0.spec.replay_endpoint == "tcp://127.0.0.1:5657"
    assert p0.models == {"m"}
    assert sorted(p.name for p in reg.all()) == ["p0", "p1"]


# -- DNS -----------------------------------------------------------------------------


async def test_dns_discovery_makes_one_pod_per_address_of_the_hostname() -> None:
    disc = DnsDiscovery(
        DnsDiscoverySettings(
            hostname="localhost", port=8123, events_port=5557, replay_port=5657, models=["m"]
        )
    )
    specs = {s.name: s for s in await disc.resolve()}
    assert "127.0.0.1:8123" in specs
    spec = specs["127.0.0.1:8123"]
    assert spec.url == "http://127.0.0.1:8123"
    assert spec.events_endpoint == "tcp://127.0.0.1:5557"
    assert spec.replay_endpoint == "tcp://127.0.0.1:5657"
    assert spec.models == ("m",)
    for s in specs.values():  # IPv6 addresses are bracketed in URLs and endpoints
        if ":" in s.name.rsplit(":", 1)[0]:
            assert s.url.startswith("http://[")


async def test_dns_discovery_re_resolves_and_fills_the_registry() -> None:
    disc = DnsDiscovery(DnsDiscoverySettings(hostname="localhost", port=8123, interval_s=0.01))
    reg = PodRegistry()
    async with running(disc.run(reg)):
        await wait_until(lambda: disc.resolutions >= 2)
        assert reg.get("127.0.0.1:8123") is not None


@pytest.mark.parametrize(
    "bad_name", ["kvroute-no-such-host.invalid", "x" * 70 + ".example"], ids=["nxdomain", "bad"]
)
async def test_dns_discovery_keeps_the_last_fleet_when_resolution_fails(bad_name: str) -> None:
    settings = DnsDiscoverySettings(hostname="localhost", port=8123, interval_s=0.01)
    disc = DnsDiscovery(settings)
    reg = PodRegistry()
    reg.set_pods(await disc.resolve())
    before = sorted(p.name for p in reg.all())
    settings.hostname = bad_name
    async with running(disc.run(reg)):
        await wait_until(lambda: disc.failures >= 1, timeout=30)
    assert sorted(p.name for p in reg.all()) == before
