"""A client that asks for a JSON answer (``"stream": false``) behind the picker: as
`kvroute serve` does, the picker asks the pod for a stream and assembles the JSON answer
(``proxy.stream_json_answers``, router/epp/assembled.py), so the answer's first token
is timed, ends the prefill load and teaches the policy, as a stream's does.

A real gRPC client plays Envoy's side (the messages of ``FULL_DUPLEX_STREAMED`` mode)
against a running EPP over real simulated pods."""

from __future__ import annotations

import json
from typing import Any

import pytest

from router.epp.server import EppServer
from router.proxy.assemble import streamed_body
from router.sim.wire import sse_event
from tests.epp import client as C
from tests.epp.fleet import MODEL, endpoint, running_epp, settings_for, sim_pods
from tests.epp.test_stream import chat_body, metric, pick
from tests.support.aio import wait_until

pytestmark = pytest.mark.usefixtures("grpc_server")

_LEAD = {"id": "chatcmpl-7", "object": "chat.completion.chunk", "created": 5, "model": MODEL}


def chunk(content: str | None = None, finish: str | None = None, **top: Any) -> bytes:
    """One chat completion chunk as vLLM streams it."""
    choices = [] if "usage" in top else [{"index": 0, "delta": {}, "finish_reason": finish}]
    if content is not None:
        choices[0]["delta"] = {"role": "assistant", "content": content}
    return b"data: " + json.dumps({**_LEAD, "choices": choices, **top}).encode() + b"\n\n"


USAGE = {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}
STREAM = [
    chunk("Hel"),
    chunk("lo", finish="stop"),
    chunk(usage=USAGE) + b"data: [DONE]\n\n",
]


def prefill(server: EppServer, pod: str) -> int:
    return int(server.picker.load.snapshot_now([pod])[pod][1])  # type: ignore[attr-defined]


def kinds(answers: list[C.ep.ProcessingResponse]) -> list[str | None]:
    return [a.WhichOneof("response") for a in answers]


def body_of(answer: C.ep.ProcessingResponse) -> tuple[bytes, bool]:
    streamed = answer.response_body.response.body_mutation.streamed_response
    return streamed.body, streamed.end_of_stream


async def test_a_json_answer_request_is_sent_on_asking_for_a_stream_with_its_usage() -> None:
    async with sim_pods(1) as pods, running_epp(settings_for(pods)) as (_server, ch):
        raw = chat_body("hello", max_tokens=8, temperature=0)
        stream = await pick(ch, raw)
        answer, echoed = await stream.read_request_pick()
        await stream.close()
    assert echoed == streamed_body(raw, json.loads(raw))  # as `kvroute serve` sends it
    assert C.set_headers(answer)["content-length"] == str(len(echoed))
    sent = json.loads(echoed)
    assert sent.pop("stream") is True
    assert sent.pop("stream_options") == {"include_usage": True}
    assert sent == json.loads(raw)  # nothing else changed


@pytest.mark.parametrize(
    "body",
    [
        {"stream": True},
        {"max_tokens": 1},
        {"n": 2},
        {"logprobs": True},
    ],
    ids=["a stream", "one token", "two choices", "logprobs"],
)
async def test_requests_kvroute_serve_does_not_assemble_go_as_they_came(
    body: dict[str, Any],
) -> None:
    async with sim_pods(1) as pods, running_epp(settings_for(pods)) as (_server, ch):
        raw = chat_body("hello", **body)
        stream = await pick(ch, raw)
        _, echoed = await stream.read_request_pick()
        await stream.close()
    assert echoed == raw


async def test_with_stream_json_answers_off_a_json_answer_request_goes_as_it_came() -> None:
    async with sim_pods(1) as pods:
        settings = settings_for(pods, proxy={"stream_json_answers": False})
        async with running_epp(settings) as (_server, ch):
            raw = chat_body("hello")
            stream = await pick(ch, raw)
            _, echoed = await stream.read_request_pick()
            await stream.close()
    assert echoed == raw


async def test_the_answer_is_assembled_and_its_first_chunk_is_its_first_token() -> None:
    async with sim_pods(1) as pods, running_epp(settings_for(pods)) as (server, ch):
        pod = pods[0].name
        stream = await pick(ch, chat_body("a prompt of a few words " * 20))
        await stream.read_request_pick()
        await wait_until(lambda: prefill(server, pod) > 0, "the prefill load taken")
        await stream.send(C.response_headers(content_type="text/event-stream"))
        await stream.send(C.response_body(STREAM[0], False))
        # the first chunk is the first token: timed, and the prefill load ends
        await wait_until(
            lambda: metric(server, "kvroute_ttft_seconds_count", pod=pod) == 1, "the TTFT timed"
        )
        assert prefill(server, pod) == 0
        await stream.send(C.response_body(STREAM[1], False), C.response_body(STREAM[2], True))
        # nothing came back before the end: the held headers, then the whole answer
        answers = await stream.read(2)
        await stream.close()
        await wait_until(
            lambda: metric(server, "kvroute_requests_total", pod=pod, status="200") == 1,
            "the request counted",
        )
        completion = metric(server, "kvroute_epp_usage_tokens_total", kind="completion")
    assert kinds(answers) == ["response_headers", "response_body"]
    headers = C.set_headers(answers[0], "response_headers")
    body, eos = body_of(answers[1])
    assert eos
    assert headers["content-type"] == "application/json"
    assert headers["content-length"] == str(len(body))
    assert headers["x-kvroute-pod"] == pod
    whole = json.loads(body)
    assert whole["object"] == "chat.completion"
    assert whole["id"] == "chatcmpl-7"
    assert whole["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "Hello"}, "finish_reason": "stop"}
    ]
    assert whole["usage"] == USAGE
    assert completion == 2  # the usage read from the stream


async def test_an_answer_that_ends_with_trailers_goes_back_before_them() -> None:
    async with sim_pods(1) as pods, running_epp(settings_for(pods)) as (_server, ch):
        stream = await pick(ch, chat_body("hello"))
        await stream.read_request_pick()
        await stream.send(C.response_headers(content_type="text/event-stream"))
        await stream.send(*(C.response_body(c, False) for c in STREAM))
        await stream.send(C.ep.ProcessingRequest(response_trailers=C.ep.HttpTrailers()))
        answers = await stream.read(3)
        await stream.close()
    assert kinds(answers) == ["response_headers", "response_body", "response_trailers"]
    body, eos = body_of(answers[1])
    assert not eos  # (the trailers end it)
    assert json.loads(body)["choices"][0]["message"]["content"] == "Hello"


@pytest.mark.parametrize(
    ("events", "code"),
    [
        ([STREAM[0], b'data: {"error": {"message": "engine died"}}\n\n'], "stream_error"),
        ([b"data: not json\n\n"], "stream_unreadable"),
    ],
    ids=["error event", "not a completion"],
)
async def test_a_stream_that_gives_no_whole_answer_is_an_immediate_502(
    events: list[bytes], code: str
) -> None:
    async with sim_pods(1) as pods, running_epp(settings_for(pods)) as (server, ch):
        pod = pods[0].name
        stream = await pick(ch, chat_body("hello"))
        await stream.read_request_pick()
        await stream.send(C.response_headers(content_type="text/event-stream"))
        await stream.send(*(C.response_body(e, i == len(events) - 1) for i, e in enumerate(events)))
        (answer,) = await stream.read(1)
        await stream.close()
        await wait_until(
            lambda: metric(server, "kvroute_requests_total", pod=pod, status="502") == 1,
            "the 502 counted",
        )
        errors = metric(server, "kvroute_upstream_errors_total", pod=pod, reason=code)
    immediate = answer.immediate_response
    assert immediate.status.code == 502
    assert json.loads(immediate.body)["error"]["code"] == code
    assert {h.header.key: h.header.raw_value for h in immediate.headers.set_headers}[
        "x-kvroute-pod"
    ] == pod.encode()
    assert errors == 1


@pytest.mark.parametrize(
    ("status", "content_type"),
    [(200, "application/json"), (400, "application/json"), (503, "text/plain")],
    ids=["json", "client error", "server error"],
)
async def test_a_pod_that_does_not_answer_with_a_stream_is_passed_on_as_it_came(
    status: int, content_type: str
) -> None:
    async with sim_pods(1) as pods, running_epp(settings_for(pods)) as (_server, ch):
        stream = await pick(ch, chat_body("hello"))
        await stream.read_request_pick()
        await stream.send(C.response_headers(status, content_type=content_type))
        (headers_answer,) = await stream.read(1)  # answered at once: nothing held
        await stream.send(C.response_body(b'{"choices": []}', True))
        (body_answer,) = await stream.read(1)
        await stream.close()
    assert kinds([headers_answer, body_answer]) == ["response_headers", "response_body"]
    assert "content-type" not in C.set_headers(headers_answer, "response_headers")
    assert body_of(body_answer) == (b'{"choices": []}', True)


async def test_a_responses_answer_is_its_final_event_s_response_timed_at_its_first_output() -> None:
    async with sim_pods(3) as pods, running_epp(settings_for(pods)) as (server, ch):
        raw = json.dumps({"model": MODEL, "input": "a few words " * 20}).encode()
        stream = C.Stream(ch)
        await stream.send(C.request_headers("/v1/responses"), C.request_body(raw, True))
        pick_answer, echoed = await stream.read_request_pick()
        pod = {endpoint(p): p.name for p in pods}[C.destination_metadata(pick_answer)]
        await stream.send(C.response_headers(content_type="text/event-stream"))
        final = {"id": "resp_9", "status": "completed", "output": [{"type": "message"}]}
        opening = [
            sse_event({"type": "response.created", "response": {"id": "resp_9"}}),
            sse_event({"type": "response.in_progress", "response": {"id": "resp_9"}}),
        ]
        await stream.send(*(C.response_body(e, False) for e in opening))
        opened = metric(server, "kvroute_ttft_seconds_count", pod=pod)
        delta = sse_event({"type": "response.output_text.delta", "delta": "Hi"})
        await stream.send(C.response_body(delta, False))
        await wait_until(
            lambda: metric(server, "kvroute_ttft_seconds_count", pod=pod) == 1,
            "the first output timed",
        )
        done = sse_event({"type": "response.completed", "response": final})
        await stream.send(C.response_body(done, True))
        answers = await stream.read(2)
        await stream.close()
        # the response's pod was recorded from the stream: a later GET goes there
        get = C.Stream(ch)
        await get.send(C.request_headers("/v1/responses/resp_9", method="GET", end_of_stream=True))
        (got,) = await get.read(1)
        await get.close()
    assert C.destination_metadata(got) == C.destination_metadata(pick_answer)
    assert json.loads(echoed) == {**json.loads(raw), "stream": True}
    assert opened == 0
    assert kinds(answers) == ["response_headers", "response_body"]
    assert C.set_headers(answers[0], "response_headers")["content-type"] == "application/json"
    assert json.loads(body_of(answers[1])[0]) == final


async def test_a_stream_that_ends_before_its_answer_releases_its_load_as_499() -> None:
    async with sim_pods(1) as pods, running_epp(settings_for(pods)) as (server, ch):
        pod = pods[0].name
        stream = await pick(ch, chat_body("hello"))
        await stream.read_request_pick()
        await stream.send(C.response_headers(content_type="text/event-stream"))
        await stream.send(C.response_body(STREAM[0], False))
        await wait_until(lambda: prefill(server, pod) == 0, "the first token heard")
        await stream.close()  # the client (or the proxy) gave up mid-answer
        await wait_until(
            lambda: metric(server, "kvroute_requests_total", pod=pod, status="499") == 1,
            "the request counted as 499",
        )
        inflight = server.picker.load.snapshot_now([pod])[pod][0]  # type: ignore[attr-defined]
    assert inflight == 0
