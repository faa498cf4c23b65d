"""The Responses API in a P/D fleet (router/proxy/disagg.py): a new ``/v1/responses``
request is split like a chat request (vLLM 0.32's ``ResponsesRequest`` takes
``kv_transfer_params`` and ``max_output_tokens``, and its answer returns the params), a
follow-up naming ``previous_response_id`` goes whole to the decode pod that owns it.
Simulated pods over real HTTP, the harness of tests/router/test_pd_proxy.py, and the
default split rule (a ~1,000-token input on the idle fleet splits)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from router.proxy.disagg import prefill_body
from tests.router.test_pd_proxy import DOC, MODEL, pd_router


def response(text: str = DOC, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": text, "max_output_tokens": 8, **kw}


def completed_event(sse: str) -> dict[str, Any]:
    for line in sse.splitlines():
        if line.startswith("data: ") and '"response.completed"' in line:
            event: dict[str, Any] = json.loads(line[6:])
            return event
    raise AssertionError(f"no response.completed event in {sse[-400:]!r}")


def test_a_responses_prefill_copy_asks_for_one_token_unstored_and_unstreamed() -> None:
    body = response(stream=True, background=True, store=True, stream_options={"x": 1})
    raw = httpx.Request("POST", "http://x", json=body).content
    sent = httpx.Response(200, content=prefill_body(raw, body, "responses")).json()
    assert (sent["max_output_tokens"], sent["stream"], sent["store"]) == (1, False, False)
    assert not {"background", "stream_options", "max_tokens"} & set(sent)
    assert sent["kv_transfer_params"]["do_remote_decode"] is True
    assert sent["input"] == body["input"]


@pytest.mark.parametrize("stream", [False, True])
async def test_a_new_response_is_prefilled_on_a_prefill_pod_and_decoded_on_a_decode_pod(
    stream: bool,
) -> None:
    async with pd_router() as h:
        r = await h.client.post("/v1/responses", json=response(stream=stream))
        assert r.status_code == 200, r.text
        prefill_pod, decode_pod = r.headers["x-kvroute-prefill-pod"], r.headers["x-kvroute-pod"]
        assert prefill_pod in ("sim-p0", "sim-p1") and decode_pod in ("sim-d0", "sim-d1")
        answer = completed_event(r.text)["response"] if stream else r.json()
        assert "kv_transfer_params" not in answer
        assert answer["usage"]["output_tokens"] == 8  # the decode pod's own cap, not 1
        # the prefill pod's fresh prompt had no hit: that is the usage reported (the decode
        # pod counts the pulled blocks as cached)
        assert answer["usage"]["input_tokens_details"]["cached_tokens"] == 0
        assert await h.pod_metric(decode_pod, "kvroute_sim_kv_transfers_total", outcome="ok") == 1
        assert await h.pod_metric(prefill_pod, "vllm:request_success_total") == 1
        assert h.sample("kvroute_pd_decisions_total", model=MODEL, reason="split") == 1
        assert h.sample("kvroute_pd_decisions_total", model=MODEL, reason="unsupported_kind") == 0
        # the prefill pod stored nothing: only the decode pod knows the response
        rid = answer["id"]
        assert (await h.client.get(f"{h.pods[decode_pod].url}/v1/responses/{rid}")).is_success
        got = await h.client.get(f"/v1/responses/{rid}")
        assert got.status_code == 200 and got.headers["x-kvroute-pod"] == decode_pod


async def test_a_follow_up_goes_whole_to_the_decode_pod_owning_the_previous_response() -> None:
    async with pd_router() as h:
        first = await h.client.post("/v1/responses", json=response())
        assert first.status_code == 200, first.text
        owner = first.headers["x-kvroute-pod"]
        follow = response("And the next step?", previous_response_id=first.json()["id"])
        r = await h.client.post("/v1/responses", json=follow)
        assert r.status_code == 200, r.text
        assert r.headers["x-kvroute-pod"] == owner
        assert "x-kvroute-prefill-pod" not in r.headers
        assert h.sample("kvroute_pd_decisions_total", model=MODEL, reason="split") == 1
