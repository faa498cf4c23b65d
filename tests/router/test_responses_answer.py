"""A Responses API JSON answer assembled from the pod's stream
(router/proxy/responses_answer.py, ``proxy.stream_json_answers``): the answer is the
final event's response object, whole; a stream that gives none is a 502.  Through
`kvroute serve` with a simulated pod, the router sees the answer's first token."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from router.decision.request import Routed
from router.proxy.assemble import StreamFailed, StreamUnreadable, assemblable, streamed_body
from router.proxy.responses_answer import ResponsesAssembler
from router.sim.wire import sse_event
from tests.router.app_rig import MODEL, running, sim
from tests.router.test_assemble import routed_of
from tests.router.test_json_answers import Heard, metric

RESPONSE = {
    "id": "resp_1",
    "object": "response",
    "status": "completed",
    "output": [{"type": "message", "content": [{"type": "output_text", "text": "Hi there"}]}],
    "usage": {"input_tokens": 5, "output_tokens": 2, "total_tokens": 7},
}
STREAM = b"".join(
    [
        sse_event({"type": "response.created", "response": {**RESPONSE, "status": "in_progress"}}),
        sse_event({"type": "response.in_progress", "response": {"id": "resp_1"}}),
        sse_event({"type": "response.output_text.delta", "delta": "Hi"}),
        sse_event({"type": "response.output_text.delta", "delta": " there"}),
        sse_event({"type": "response.completed", "response": RESPONSE}),
    ]
)


def assemble(stream: bytes, size: int | None = None) -> Any:
    whole = ResponsesAssembler()
    size = size or max(1, len(stream))
    for i in range(0, len(stream), size):
        whole.feed(stream[i : i + size])
    return json.loads(whole.answer())


@pytest.mark.parametrize("size", [1, 7, 64, None])
def test_the_answer_is_the_final_event_s_response_however_the_stream_is_cut(
    size: int | None,
) -> None:
    assert assemble(STREAM, size) == RESPONSE
    assert assemble(STREAM.replace(b"\n", b"\r\n"), size) == RESPONSE


@pytest.mark.parametrize("final", ["response.incomplete", "response.failed"])
def test_an_incomplete_or_failed_response_is_the_answer_in_that_state(final: str) -> None:
    ended = {**RESPONSE, "status": final.split(".")[1]}
    stream = STREAM.replace(
        sse_event({"type": "response.completed", "response": RESPONSE}),
        sse_event({"type": final, "response": ended}),
    )
    assert assemble(stream) == ended


def test_an_error_event_fails_the_answer_with_its_message() -> None:
    error = sse_event({"type": "error", "code": "500", "message": "the engine died"})
    with pytest.raises(StreamFailed, match="the engine died"):
        assemble(STREAM.split(b"event: response.completed")[0] + error)


@pytest.mark.parametrize(
    "stream",
    [
        STREAM.split(b"event: response.completed")[0],  # ended before its final event
        b"event: response.completed\ndata: not json\n\n",
        b'event: response.completed\ndata: {"type": "response.completed"}\n\n',
        b"",
    ],
    ids=["no final event", "final not JSON", "final without response", "empty"],
)
def test_a_stream_without_a_whole_final_response_is_unreadable(stream: bytes) -> None:
    with pytest.raises(StreamUnreadable):
        assemble(stream)


def _routed(**body: Any) -> Routed:
    return routed_of("responses", body)


def test_which_responses_requests_are_assembled_and_what_is_sent_on() -> None:
    assert assemblable(_routed(input="hi"))
    assert not assemblable(_routed(input="hi", stream=True))  # a stream is relayed
    assert not assemblable(_routed(input="hi", background=True))  # its answer is queued
    raw = b'{"model": "m", "input": "hi"}'
    sent = json.loads(streamed_body(raw, json.loads(raw), "responses"))
    assert sent == {"model": "m", "input": "hi", "stream": True}  # no stream_options


def _responses(text: str, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": text, **kw}


async def test_through_the_router_the_answer_is_the_pod_s_own_and_its_first_token_is_seen() -> None:
    body = _responses("tell me something", max_output_tokens=6)
    async with running([sim(0)]) as rig:
        heard = Heard(rig)
        through = await rig.client.post("/v1/responses", json=body)
        first_tokens = list(heard.first_tokens)
        text = await rig.metrics()
        async with httpx.AsyncClient() as direct:
            own = (await direct.post(rig.pods[0].url + "/v1/responses", json=body)).json()
        # the answer's owner was recorded: a follow-up goes to the same pod
        follow = await rig.client.post(
            "/v1/responses", json={**body, "previous_response_id": through.json()["id"]}
        )
    assert through.status_code == 200, through.text
    assert through.headers["content-type"] == "application/json"
    answer = through.json()
    assert set(answer) == set(own)
    assert answer["output"][0]["content"][0]["text"] == own["output"][0]["content"][0]["text"]
    assert answer["status"] == own["status"]
    tokens = ("input_tokens", "output_tokens", "total_tokens")  # (the second one hit the cache)
    assert [answer["usage"][k] for k in tokens] == [own["usage"][k] for k in tokens]
    assert len(first_tokens) == 1
    assert metric(text, "kvroute_ttft_seconds_count", pod="sim-0") == 1
    assert follow.status_code == 200 and follow.headers["x-kvroute-pod"] == "sim-0"


async def test_with_the_switch_off_a_responses_json_answer_goes_as_it_came() -> None:
    async with running([sim(0)], proxy={"stream_json_answers": False}) as rig:
        heard = Heard(rig)
        r = await rig.client.post("/v1/responses", json=_responses("hi", max_output_tokens=3))
        text = await rig.metrics()
    assert r.status_code == 200 and r.json()["object"] == "response"
    assert heard.first_tokens == []
    assert metric(text, "kvroute_ttft_seconds_count", pod="sim-0") == 0
