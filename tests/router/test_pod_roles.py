"""Pod roles (prefill / decode / both) from every discovery source, per model."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from router.fleet.discovery import (
    DiscoverySettings,
    DnsDiscovery,
    DnsDiscoverySettings,
    StaticDiscovery,
)
from router.fleet.k8s import K8sDiscovery
from router.fleet.pods import PodRegistry, PodSpec
from router.fleet.roles import RoleError, can_decode, can_prefill, parse_role, parse_role_map
from tests.router.discovery_support import k8s_pod, k8s_settings


def test_roles_parse_llmd_spellings_and_name_a_bad_value() -> None:
    assert parse_role(" Prefill ") == "prefill"
    assert parse_role("prefill-decode") == "both"
    assert parse_role_map("a=prefill, b=decode,") == {"a": "prefill", "b": "decode"}
    with pytest.raises(RoleError, match=r"llm-d\.ai/role='encode' is not a pod role"):
        parse_role("encode", "llm-d.ai/role")
    with pytest.raises(RoleError, match="'a' is not MODEL=ROLE"):
        parse_role_map("a", "kvroute.io/roles")


def test_a_prefill_pod_takes_no_whole_request_and_a_decode_pod_no_prefill_half() -> None:
    assert can_prefill("prefill") and can_prefill("both") and not can_prefill("decode")
    assert can_decode("decode") and can_decode("both") and not can_decode("prefill")


def test_a_spec_defaults_to_both_and_overrides_per_model() -> None:
    spec = PodSpec(name="p", url="http://x", role="prefill", roles=(("m2", "decode"),))
    assert spec.role_for("m1") == "prefill"
    assert spec.role_for("m2") == "decode"
    assert PodSpec(name="q", url="http://x").role_for("m1") == "both"


async def test_static_pods_carry_their_role_and_per_model_roles() -> None:
    settings = DiscoverySettings.model_validate(
        {
            "static": [
                {"name": "p0", "url": "http://127.0.0.1:1", "models": ["m"], "role": "prefill"},
                {
                    "name": "d0",
                    "url": "http://127.0.0.1:2",
                    "models": ["m", "n"],
                    "role": "decode",
                    "roles": {"n": "prefill-decode"},
                },
                {"name": "b0", "url": "http://127.0.0.1:3", "models": ["m"]},
            ]
        }
    )
    reg = PodRegistry()
    await StaticDiscovery(settings.static).run(reg)
    assert [p.name for p in reg.candidates_for_role("m", "prefill", "both")] == ["p0", "b0"]
    assert [p.name for p in reg.candidates_for_role("m", "decode", "both")] == ["d0", "b0"]
    assert reg.get("d0") is not None and reg.get("d0").role_for("n") == "both"  # type: ignore[union-attr]


def test_a_static_pod_with_an_unknown_role_fails_the_settings_naming_it() -> None:
    with pytest.raises(ValidationError, match="'decoder' is not a pod role"):
        DiscoverySettings.model_validate(
            {"static": [{"name": "a", "url": "http://127.0.0.1:1", "role": "decoder"}]}
        )


async def test_every_address_of_a_dns_source_gets_the_sources_role() -> None:
    disc = DnsDiscovery(
        DnsDiscoverySettings(hostname="localhost", role="decode", roles={"m": "both"})
    )
    specs = await disc.resolve()
    assert specs
    assert {s.role for s in specs} == {"decode"}
    assert {s.role_for("m") for s in specs} == {"both"}


def test_k8s_role_comes_from_kvroute_or_llmd_labels_then_annotations(tmp_path: Path) -> None:
    disc = K8sDiscovery(k8s_settings("http://127.0.0.1:1", tmp_path, role="both"))
    llmd = k8s_pod("a")
    llmd["metadata"]["labels"] = {"llm-d.ai/role": "prefill"}
    assert disc.spec_of(llmd).role == "prefill"
    both_labels = k8s_pod("b")
    both_labels["metadata"]["labels"] = {"llm-d.ai/role": "prefill", "kvroute.io/role": "decode"}
    assert disc.spec_of(both_labels).role == "decode"  # kvroute's key comes first
    annotated = k8s_pod(
        "c", annotations={"kvroute.io/role": "decode", "kvroute.io/roles": "m2=prefill"}
    )
    spec = disc.spec_of(annotated)
    assert (spec.role, spec.role_for("m2")) == ("decode", "prefill")
    assert disc.spec_of(k8s_pod("d")).role == "both"


def test_k8s_pod_with_a_bad_role_is_skipped_and_the_reason_kept(tmp_path: Path) -> None:
    disc = K8sDiscovery(k8s_settings("http://127.0.0.1:1", tmp_path))
    bad = k8s_pod("bad")
    bad["metadata"]["labels"] = {"llm-d.ai/role": "encode"}
    disc._pods = {"bad": bad, "good": k8s_pod("good", ip="10.0.0.2")}
    assert [s.name for s in disc.current_specs()] == ["good"]
    assert "llm-d.ai/role='encode'" in disc.skipped["bad"]
