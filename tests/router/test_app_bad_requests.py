"""Every bad request the router's API refuses: an OpenAI error JSON naming what is wrong,
counted by reason."""

from __future__ import annotations

from tests.router.app_rig import MODEL, Rig, assert_openai_error, chat

# -- every bad request -------------------------------------------------------------------


async def test_invalid_json_is_400(rig: Rig) -> None:
    r = await rig.client.post(
        "/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    await assert_openai_error(r, 400, "invalid_json")


async def test_a_json_array_body_is_400(rig: Rig) -> None:
    r = await rig.client.post("/v1/chat/completions", json=[1, 2])
    await assert_openai_error(r, 400, "invalid_json")


async def test_missing_model_is_400_naming_the_param(rig: Rig) -> None:
    r = await rig.client.post("/v1/chat/completions", json={"messages": [{"role": "user"}]})
    err = await assert_openai_error(r, 400, "missing_model")
    assert err["param"] == "model"


async def test_empty_messages_is_400(rig: Rig) -> None:
    r = await rig.client.post("/v1/chat/completions", json={"model": MODEL, "messages": []})
    err = await assert_openai_error(r, 400, "invalid_messages")
    assert err["param"] == "messages"


async def test_message_without_role_is_400(rig: Rig) -> None:
    r = await rig.client.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": [{"content": "hi"}]}
    )
    err = await assert_openai_error(r, 400, "invalid_messages")
    assert err["param"] == "messages[0]"


async def test_bad_prompt_is_400(rig: Rig) -> None:
    for prompt in (None, 5, [], [1, "a"], [-1]):
        r = await rig.client.post("/v1/completions", json={"model": MODEL, "prompt": prompt})
        await assert_openai_error(r, 400, "invalid_prompt")


async def test_non_boolean_stream_is_400(rig: Rig) -> None:
    r = await rig.client.post("/v1/chat/completions", json=chat(stream="yes"))
    await assert_openai_error(r, 400, "invalid_stream")


async def test_unknown_model_is_404_listing_the_served_models(rig: Rig) -> None:
    r = await rig.client.post("/v1/chat/completions", json={**chat(), "model": "gpt-9"})
    err = await assert_openai_error(r, 404, "model_not_found")
    assert "gpt-9" in err["message"] and MODEL in err["message"]
    assert err["type"] == "not_found_error"


async def test_prompt_over_the_pods_max_model_len_is_400(rig: Rig) -> None:
    r = await rig.client.post("/v1/chat/completions", json=chat("x" * 5000))
    err = await assert_openai_error(r, 400, "context_length_exceeded")
    assert "4096" in err["message"]


async def test_bad_requests_are_counted_by_reason(rig: Rig) -> None:
    await rig.client.post("/v1/chat/completions", json={"model": MODEL, "messages": []})
    await rig.client.post("/v1/chat/completions", json={**chat(), "model": "nope"})
    metrics = await rig.metrics()
    assert 'kvroute_bad_requests_total{reason="invalid_messages"} 1.0' in metrics
    assert 'kvroute_bad_requests_total{reason="model_not_found"} 1.0' in metrics


async def test_unknown_route_is_an_openai_404(rig: Rig) -> None:
    r = await rig.client.get("/v1/nothing")
    assert r.status_code == 404
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
