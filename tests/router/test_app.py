"""The router's API in front of real simulated vLLM pods: answers, /v1/models, /ready,
/health, model and LoRA filtering, completions forms (the rig: tests/router/app_rig.py)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.router.app_rig import MODEL, Rig, assert_openai_error, chat, running, sim

# -- answers ---------------------------------------------------------------------------


async def test_chat_completion_is_answered_by_a_pod_named_in_the_header(rig: Rig) -> None:
    r = await rig.client.post("/v1/chat/completions", json=chat())
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "chat.completion"
    assert r.headers["x-kvroute-pod"] in {"sim-0", "sim-1"}


async def test_streaming_chat_is_relayed_as_sse(rig: Rig) -> None:
    async with rig.client.stream("POST", "/v1/chat/completions", json=chat(stream=True)) as r:
        assert r.status_code == 200
        body = b"".join([c async for c in r.aiter_raw()])
    assert body.startswith(b"data: ") and body.rstrip().endswith(b"data: [DONE]")


@pytest.mark.parametrize(
    "prompt", ["once upon a time", ["a one-element batch"], [1, 2, 3, 4], [[5, 6, 7]]]
)
async def test_completions_accept_every_prompt_form(rig: Rig, prompt: Any) -> None:
    r = await rig.client.post(
        "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 4}
    )
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "text_completion"


async def test_lora_adapter_requests_go_only_to_pods_serving_it(rig: Rig) -> None:
    for i in range(6):
        r = await rig.client.post(
            "/v1/chat/completions", json={**chat(f"q{i}"), "model": "sql-lora"}
        )
        assert r.status_code == 200, r.text
        assert r.headers["x-kvroute-pod"] == "sim-1"


async def test_models_lists_the_union_of_what_pods_serve(rig: Rig) -> None:
    r = await rig.client.get("/v1/models")
    ids = {m["id"] for m in r.json()["data"]}
    assert ids == {MODEL, "sql-lora"}
    by_id = {m["id"]: m for m in r.json()["data"]}
    assert by_id[MODEL]["max_model_len"] == 4096
    assert by_id["sql-lora"]["parent"] == MODEL


async def test_health_and_ready(rig: Rig) -> None:
    assert (await rig.client.get("/health")).json() == {"status": "ok"}
    r = await rig.client.get("/ready")
    assert r.status_code == 200
    assert r.json()["healthy_pods"][MODEL] == 2


async def test_ready_is_503_when_a_configured_model_has_no_healthy_pod(rig: Rig) -> None:
    for p in rig.gateway.registry.all():
        p.healthy = False
    r = await rig.client.get("/ready")
    assert r.status_code == 503
    assert r.json()["ready"] is False


async def test_ready_checks_every_configured_model() -> None:
    async with running([sim(0)], models=[MODEL, "other-model"]) as r:
        resp = await r.client.get("/ready")
        assert resp.status_code == 503
        assert resp.json()["healthy_pods"] == {MODEL: 1, "other-model": 0}


async def test_unhealthy_pods_get_no_requests_and_a_model_without_healthy_pods_is_503(
    rig: Rig,
) -> None:
    rig.gateway.registry.get("sim-0").healthy = False  # type: ignore[union-attr]
    for i in range(4):
        r = await rig.client.post("/v1/chat/completions", json=chat(f"x{i}"))
        assert r.headers["x-kvroute-pod"] == "sim-1"
    rig.gateway.registry.get("sim-1").healthy = False  # type: ignore[union-attr]
    r = await rig.client.post("/v1/chat/completions", json=chat())
    await assert_openai_error(r, 503, "no_healthy_pod")
