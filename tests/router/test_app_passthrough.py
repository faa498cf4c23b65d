"""Passthrough endpoints (/tokenize and the like): relayed to a pod serving the model,
the least loaded one."""

from __future__ import annotations

import httpx
import pytest

from router.config import Settings
from tests.router.app_rig import MODEL, Rig, assert_openai_error, running, sim

# -- passthrough endpoints ---------------------------------------------------------------


async def test_tokenize_is_relayed_to_a_pod_serving_the_model(rig: Rig) -> None:
    body = {"model": MODEL, "prompt": "hello there"}
    r = await rig.client.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    pod = {p.name: p for p in rig.pods}[r.headers["x-kvroute-pod"]]
    async with httpx.AsyncClient() as direct:
        assert r.json() == (await direct.post(f"{pod.url}/tokenize", json=body)).json()


async def test_passthrough_requests_go_to_the_least_loaded_pod_ties_rotated(rig: Rig) -> None:
    seen = set()
    for _ in range(4):
        r = await rig.client.post("/tokenize", json={"model": MODEL, "prompt": "x"})
        assert r.status_code == 200, r.text
        seen.add(r.headers["x-kvroute-pod"])
    assert seen == {"sim-0", "sim-1"}


async def test_a_passthrough_request_for_an_adapter_goes_only_to_pods_serving_it(
    rig: Rig,
) -> None:
    for _ in range(3):
        r = await rig.client.post("/tokenize", json={"model": "sql-lora", "prompt": "x"})
        assert r.headers["x-kvroute-pod"] == "sim-1"


async def test_a_passthrough_request_without_model_needs_a_single_served_model(
    rig: Rig,
) -> None:
    r = await rig.client.post("/tokenize", json={"prompt": "x"})
    err = await assert_openai_error(r, 400, "missing_model")
    assert "2 models are served" in err["message"]
    async with running([sim(0)]) as one:
        r = await one.client.post("/tokenize", json={"prompt": "x"})
        assert r.status_code == 200, r.text
        assert r.headers["x-kvroute-pod"] == "sim-0"


async def test_a_passthrough_path_the_pod_lacks_answers_with_the_pods_own_status(
    rig: Rig,
) -> None:
    r = await rig.client.post("/v1/score", json={"model": MODEL, "text_1": "a", "text_2": "b"})
    assert r.status_code == 404
    assert r.headers["x-kvroute-pod"] in {"sim-0", "sim-1"}  # the pod said 404, not us


async def test_passthrough_paths_are_a_setting() -> None:
    async with running([sim(0)], proxy={"passthrough_paths": ["/classify"]}) as rig:
        r = await rig.client.post("/tokenize", json={"model": MODEL, "prompt": "x"})
        await assert_openai_error(r, 404, "http")
        r = await rig.client.post("/classify", json={"model": MODEL, "input": "x"})
        assert r.headers["x-kvroute-pod"] == "sim-0"
    for bad in ("/v1/chat/completions", "tokenize", "/metrics"):
        with pytest.raises(ValueError, match="passthrough path"):
            Settings.model_validate({"proxy": {"passthrough_paths": [bad]}})
