"""The ext_proc stream, spoken by a real gRPC client playing Envoy's side against a
running EPP (real gRPC server, real simulated pods with KV events and health checks).

Each test sends the messages Envoy sends in ``FULL_DUPLEX_STREAMED`` mode and reads the
EPP's answers: the pick (header and metadata), the request body echoed byte for byte,
the served-endpoint feedback, the accounting, and the immediate responses."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from router.epp import protocol as P
from router.epp.server import EppServer
from router.sim.wire import sse_event
from tests.epp import client as C
from tests.epp.fleet import MODEL, endpoint, running_epp, settings_for, sim_pods
from tests.support.aio import wait_until

CHAT = "/v1/chat/completions"
#: every test once on each gRPC server (tests/epp/conftest.py)
pytestmark = pytest.mark.usefixtures("grpc_server")


def chat_body(text: str, **kw: object) -> bytes:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], **kw}
    return json.dumps(body).encode()


def metric(server: EppServer, name: str, **labels: str) -> float:
    """The sample ``name{labels}`` of the EPP's /metrics (0 when absent)."""
    for family in text_string_to_metric_families(server.picker.metrics.render().decode()):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


async def pick(channel: grpc.aio.Channel, body: bytes, **headers_kw: object) -> C.Stream:
    stream = C.Stream(channel)
    await stream.send(C.request_headers(CHAT, **headers_kw), C.request_body(body, True))  # type: ignore[arg-type]
    return stream


async def test_a_chat_body_is_picked_at_its_end_and_sent_back_byte_for_byte() -> None:
    async with sim_pods(3) as pods, running_epp(settings_for(pods)) as (_server, channel):
        # (a stream: a request for a JSON answer is asked of its pod as a stream,
        # test_a_json_answer_request_is_sent_on_asking_for_a_stream_with_its_usage)
        body = chat_body("a long document " * 9000, stream=True)  # ~150 KB
        parts = [body[:50_000], body[50_000:120_000], body[120_000:]]  # one part > 62,000
        stream = C.Stream(channel)
        await stream.send(
            C.request_headers(CHAT),
            *(C.request_body(p, i == len(parts) - 1) for i, p in enumerate(parts)),
        )
        answer, echoed = await stream.read_request_pick()
        await stream.close()
    headers = C.set_headers(answer)
    assert headers[P.DESTINATION_KEY] == C.destination_metadata(answer)
    assert headers[P.DESTINATION_KEY] in {endpoint(p) for p in pods}
    assert headers["content-length"] == str(len(body))
    assert answer.request_headers.response.clear_route_cache
    assert echoed == body


async def test_the_endpoint_list_is_the_ranking_best_first_in_header_and_metadata() -> None:
    async with sim_pods(3) as pods, running_epp(settings_for(pods), endpoints=3) as (_s, ch):
        stream = await pick(ch, chat_body("hello"))
        answer, _ = await stream.read_request_pick()
        await stream.close()
    listed = C.set_headers(answer)[P.DESTINATION_KEY]
    assert listed == C.destination_metadata(answer)
    assert sorted(listed.split(",")) == sorted(endpoint(p) for p in pods)


@pytest.mark.parametrize("form", ["list", "comma-separated string"])
async def test_a_subset_hint_restricts_the_candidates(form: str) -> None:
    async with sim_pods(3) as pods, running_epp(settings_for(pods), endpoints=3) as (_s, ch):
        allowed = [endpoint(pods[2]), endpoint(pods[0])]
        value = allowed if form == "list" else ",".join(allowed)
        meta = C.metadata(P.SUBSET_NS, P.SUBSET_KEY, value)
        stream = await pick(ch, chat_body("hello"), meta=meta)
        answer, _ = await stream.read_request_pick()
        await stream.close()
    assert sorted(C.destination_metadata(answer).split(",")) == sorted(allowed)


async def test_a_subset_hint_allowing_no_pod_is_an_immediate_503() -> None:
    async with sim_pods(2) as pods, running_epp(settings_for(pods)) as (server, ch):
        meta = C.metadata(P.SUBSET_NS, P.SUBSET_KEY, ["10.255.0.1:8000"])
        stream = await pick(ch, chat_body("hello"), meta=meta)
        (answer,) = await stream.read(1)
        await stream.close()
        assert metric(server, "kvroute_bad_requests_total", reason="no_pod_in_subset") == 1
    assert answer.immediate_response.status.code == 503
    assert json.loads(answer.immediate_response.body)["error"]["code"] == "no_pod_in_subset"


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{not json", 400, "invalid_json"),
        (
            json.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}]}),
            404,
            "model_not_found",
        ),
        (json.dumps({"model": MODEL, "messages": []}), 400, "invalid_messages"),
    ],
)
async def test_a_bad_request_is_answered_as_kvroute_serve_answers_it(
    body: bytes | str, status: int, code: str
) -> None:
    raw = body.encode() if isinstance(body, str) else body
    async with sim_pods(1) as pods, running_epp(settings_for(pods)) as (_server, ch):
        stream = await pick(ch, raw)
        (answer,) = await stream.read(1)
        await stream.close()
    imm = answer.immediate_response
    assert imm.status.code == status
    assert json.loads(imm.body)["error"]["code"] == code
    assert {h.header.key: h.header.raw_value for h in imm.headers.set_headers}[
        "content-type"
    ] == b"application/json"


async def test_no_healthy_pod_is_an_immediate_503_from_a_picker_that_stays_ready() -> None:
    dead = {"name": "dead-0", "url": "http://127.0.0.1:9", "models": [MODEL]}
    settings = settings_for([], discovery={"static": [dead]}, health={"failure_threshold": 1})
    async with running_epp(settings) as (server, ch):
        await wait_until(lambda: not server.picker.registry.all()[0].healthy, "the dead pod out")
        stream = await pick(ch, chat_body("hello"))
        (answer,) = await stream.read(1)
        await stream.close()
        health = health_pb2_grpc.HealthStub(ch)
        ready = await health.Check(health_pb2.HealthCheckRequest(service="readiness"))
        alive = await health.Check(health_pb2.HealthCheckRequest(service="liveness"))
    assert answer.immediate_response.status.code == 503
    assert ready.status == health_pb2.HealthCheckResponse.SERVING  # it answers: 503
    assert alive.status == health_pb2.HealthCheckResponse.SERVING


async def test_health_services_answer_serving_when_pods_are_ready() -> None:
    async with sim_pods(1) as pods, running_epp(settings_for(pods)) as (_server, ch):
        health = health_pb2_grpc.HealthStub(ch)
        answers = {
            service: (await health.Check(health_pb2.HealthCheckRequest(service=service))).status
            for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor")
        }
    assert set(answers.values()) == {health_pb2.HealthCheckResponse.SERVING}


async def test_the_served_endpoint_carries_the_load_ttft_and_status() -> None:
    async with sim_pods(2) as pods, running_epp(settings_for(pods), endpoints=2) as (server, ch):
        names = {endpoint(p): p.name for p in pods}
        stream = await pick(ch, chat_body("hello", stream=True))
        answer, _ = await stream.read_request_pick()
        first, second = C.destination_metadata(answer).split(",")
        load = server.picker.load
        await wait_until(  # (taken once the pick is on its way: after_send)
            lambda: load.snapshot_now([names[first]])[names[first]][0] == 1,  # type: ignore[attr-defined]
            "the picked endpoint's load taken",
        )
        # the proxy's retry went down the list: the second endpoint answered
        await stream.send(C.response_headers(served=second, content_type="text/event-stream"))
        (headers_answer,) = await stream.read(1)
        inflight = load.snapshot_now(list(names.values()))  # type: ignore[attr-defined]
        await stream.send(C.response_body(b"data: [DONE]\n\n", True))
        (body_answer,) = await stream.read(1)
        await stream.close()
        await wait_until(
            lambda: metric(server, "kvroute_requests_total", pod=names[second], status="200") == 1,
            "the request counted on the pod that served it",
        )
        assert metric(server, "kvroute_ttft_seconds_count", pod=names[second]) == 1
        assert metric(server, "kvroute_epp_served_elsewhere_total") == 1
        assert metric(server, "kvroute_prompt_tokens_total", pod=names[second]) > 0
        assert metric(server, "kvroute_prompt_tokens_total", pod=names[first]) == 0
        final = load.snapshot_now(list(names.values()))  # type: ignore[attr-defined]
    assert inflight[names[second]][0] == 1 and inflight[names[first]][0] == 0
    assert C.set_headers(headers_answer, "response_headers")["x-kvroute-pod"] == names[second]
    assert body_answer.response_body.response.body_mutation.streamed_response.end_of_stream
    assert all(n == 0 for n, _ in final.values())


@pytest.mark.parametrize(
    ("streamed", "max_tokens", "status", "first"),
    [
        (True, 8, 200, True),
        (False, 8, 200, False),
        (False, 1, 200, True),
        (True, 8, 400, False),
    ],
    ids=["stream", "json sent whole", "json of one token", "error to a stream"],
)
async def test_only_a_streamed_answer_s_first_byte_is_a_first_token(
    streamed: bool, max_tokens: int, status: int, first: bool
) -> None:
    """vLLM sends a JSON answer whole, after its last token: when the pod answers JSON
    (to the stream asked of it, tests/epp/test_assembled.py, or with
    ``proxy.stream_json_answers`` off), its first byte says nothing of the prefill, so
    it neither ends the request's prefill load nor times a TTFT, and the policy's
    learned prefill rate is not fed the decode time (the proxy front does the same).
    Unless it is of one token: then its last token is its first."""
    async with sim_pods(1) as pods, running_epp(settings_for(pods)) as (server, ch):
        pod = pods[0].name
        policy = server.picker.policy
        heard: list[float] = []
        hook = policy.on_first_token

        def recorded(request: Any, at: str, ttft_s: float) -> None:
            heard.append(ttft_s)
            hook(request, at, ttft_s)

        policy.on_first_token = recorded  # type: ignore[method-assign,assignment]
        body = chat_body("a prompt of a few words " * 20, stream=streamed, max_tokens=max_tokens)
        stream = await pick(ch, body)
        await stream.read_request_pick()
        await wait_until(  # (taken once the pick is on its way: after_send)
            lambda: server.picker.load.snapshot_now([pod])[pod][1] > 0,  # type: ignore[attr-defined]
            "the prefill load taken",
        )
        prefill_before = server.picker.load.snapshot_now([pod])[pod][1]  # type: ignore[attr-defined]
        kind = "text/event-stream" if streamed and status == 200 else "application/json"
        await stream.send(C.response_headers(status, content_type=kind))
        await stream.read(1)
        if status != 200:  # an error's body, whole: nothing of it is a first token
            await stream.send(C.response_body(b'{"error": {"message": "bad"}}', True))
            await stream.read(1)
            await stream.close()
            ttft_count = metric(server, "kvroute_ttft_seconds_count", pod=pod)
            assert (ttft_count, heard) == (0.0, [])
            return
        chunk = b'data: {"choices": []}\n\n' if streamed else b'{"choices": [], '
        await stream.send(C.response_body(chunk, False))
        if streamed:
            await stream.read(1)
        elif first:  # a held JSON answer: nothing comes back before its end
            await wait_until(lambda: heard, "the first token heard")
        prefill_after = server.picker.load.snapshot_now([pod])[pod][1]  # type: ignore[attr-defined]
        ttft_count = metric(server, "kvroute_ttft_seconds_count", pod=pod)
        rest = b"data: [DONE]\n\n" if streamed else b'"usage": null}'
        await stream.send(C.response_body(rest, True))
        await stream.read(1)
        await stream.close()
    assert prefill_before > 0
    if first:
        assert (prefill_after, ttft_count, len(heard)) == (0, 1.0, 1)
    else:
        assert (prefill_after, ttft_count, heard) == (prefill_before, 0.0, [])


async def test_a_json_answer_the_gateway_carries_leaves_the_queue_when_its_pod_counts_it() -> None:
    """With ``proxy.stream_json_answers`` off the picker never sees a JSON answer's first
    token; the pod's scraped ``vllm:time_to_first_token_seconds_count`` shows it past its
    prefill, and its load is released long before the answer ends
    (router/fleet/first_tokens.py)."""
    async with sim_pods(1) as pods:
        json_as_it_came = {"stream_json_answers": False}
        settings = settings_for(pods, proxy=json_as_it_came, scrape={"interval_s": 0.1})
        async with running_epp(settings) as (server, ch):
            pod, picker = pods[0].name, server.picker
            await wait_until(lambda: picker.scraper.get(pod) is not None, "a first scrape")
            body = chat_body("a prompt of a few words " * 20, max_tokens=8)
            stream = await pick(ch, body)
            await stream.read_request_pick()

            def prefill() -> int:
                return int(picker.load.snapshot_now([pod])[pod][1])  # type: ignore[attr-defined]

            await wait_until(lambda: prefill() > 0, "the prefill load taken")
            # the gateway's request reaches the pod (as Envoy would send it): its count moves
            async with httpx.AsyncClient() as direct:
                r = await direct.post(pods[0].url + "/v1/chat/completions", content=body)
            assert r.status_code == 200
            await wait_until(lambda: prefill() == 0, "the prefill load released by a scrape")
            released = metric(server, "kvroute_unseen_first_tokens_total")
            await stream.send(C.response_headers(content_type="application/json"))
            await stream.read(1)
            await stream.send(C.response_body(r.content, True))
            await stream.read(1)
            await stream.close()
    assert released == 1
    assert metric(server, "kvroute_ttft_seconds_count", pod=pod) == 0


async def test_a_responses_stream_s_first_token_is_its_first_event_after_the_opening_ones() -> None:
    """vLLM opens a streamed Responses answer with ``response.created`` and
    ``response.in_progress`` before its engine runs the request: those chunks neither
    time a TTFT nor end the prefill load.  The first output event does."""
    async with sim_pods(1) as pods, running_epp(settings_for(pods)) as (server, ch):
        pod = pods[0].name
        body = json.dumps({"model": MODEL, "input": "a few words " * 20, "stream": True})
        stream = C.Stream(ch)
        await stream.send(C.request_headers("/v1/responses"), C.request_body(body.encode(), True))
        await stream.read_request_pick()
        load = server.picker.load

        def prefill() -> int:
            return int(load.snapshot_now([pod])[pod][1])  # type: ignore[attr-defined]

        before = prefill()
        await stream.send(C.response_headers(content_type="text/event-stream"))
        await stream.read(1)
        opening = [
            sse_event({"type": "response.created", "response": {"id": "resp_9"}}),
            sse_event({"type": "response.in_progress", "response": {"id": "resp_9"}}),
        ]
        for chunk in opening:
            await stream.send(C.response_body(chunk, False))
            await stream.read(1)
        opened = (prefill(), metric(server, "kvroute_ttft_seconds_count", pod=pod))
        delta = sse_event({"type": "response.output_text.delta", "delta": "Hi"})
        await stream.send(C.response_body(delta, False))
        await stream.read(1)
        output = (prefill(), metric(server, "kvroute_ttft_seconds_count", pod=pod))
        done = sse_event({"type": "response.completed", "response": {"id": "resp_9"}})
        await stream.send(C.response_body(done, True))
        await stream.read(1)
        await stream.close()
    assert before > 0
    assert opened == (before, 0.0)
    assert output == (0, 1.0)


async def test_a_streamed_answer_is_sent_back_chunk_by_chunk_as_it_arrives() -> None:
    async with sim_pods(1) as pods, running_epp(settings_for(pods)) as (server, ch):
        stream = await pick(ch, chat_body("hello", stream=True))
        _answer, _ = await stream.read_request_pick()
        await stream.send(C.response_headers(content_type="text/event-stream"))
        await stream.read(1)
        events = [b'data: {"choices": [{"delta": {"content": "%d"}}]}\n\n' % i for i in range(5)]
        echoed = []
        for _i, event in enumerate(events):
            await stream.send(C.response_body(event, False))  # one chunk in ...
            (back,) = await stream.read(1)  # ... one chunk out, before the next is sent
            echoed.append(back.response_body.response.body_mutation.streamed_response.body)
        usage = b'data: {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 5}}\n\n'
        await stream.send(C.response_body(usage + b"data: [DONE]\n\n", True))
        (last,) = await stream.read(1)
        await stream.close()
        await wait_until(
            lambda: metric(server, "kvroute_epp_usage_tokens_total", kind="completion") == 5,
            "the usage counted",
        )
    assert echoed == events
    assert last.response_body.response.body_mutation.streamed_response.end_of_stream


async def test_a_json_answer_goes_back_whole_at_its_end_as_one_chunk() -> None:
    async with sim_pods(1) as pods, running_epp(settings_for(pods)) as (server, ch):
        stream = await pick(ch, chat_body("hello"))
        await stream.read_request_pick()
        await stream.send(C.response_headers(content_type="application/json"))
        await stream.read(1)
        answer = b'{"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}'
        # as Envoy relays a pod's HTTP/1.1 answer: the body, then an empty end of stream
        await stream.send(C.response_body(answer[:20], False), C.response_body(answer[20:], False))
        await stream.send(C.response_body(b"", True))
        (back,) = await stream.read(1)
        await stream.close()
        await wait_until(
            lambda: metric(server, "kvroute_epp_usage_tokens_total", kind="completion") == 3,
            "the usage counted",
        )
    streamed = back.response_body.response.body_mutation.streamed_response
    assert (streamed.body, streamed.end_of_stream) == (answer, True)


async def test_a_held_json_answer_goes_back_before_the_answer_s_trailers() -> None:
    async with sim_pods(1) as pods, running_epp(settings_for(pods)) as (_, ch):
        stream = await pick(ch, chat_body("hello"))
        await stream.read_request_pick()
        await stream.send(C.response_headers(content_type="application/json"))
        await stream.read(1)
        await stream.send(C.response_body(b'{"choices": []}', False))
        await stream.send(
            C.ep.ProcessingRequest(response_trailers=C.ep.HttpTrailers())  # an HTTP/2 answer
        )
        body_back, trailers_back = await asyncio.wait_for(stream.read(2), 10)
        await stream.close()
    streamed = body_back.response_body.response.body_mutation.streamed_response
    assert (streamed.body, streamed.end_of_stream) == (b'{"choices": []}', False)
    assert trailers_back.WhichOneof("response") == "response_trailers"


async def test_a_large_json_answer_is_sent_back_in_chunks_of_at_most_62000_bytes() -> None:
    async with sim_pods(1) as pods, running_epp(settings_for(pods)) as (_, ch):
        stream = await pick(ch, chat_body("hello"))
        await stream.read_request_pick()
        await stream.send(C.response_headers(content_type="application/json"))
        await stream.read(1)
        answer = b'{"text": "' + b"x" * 150_000 + b'"}'
        pieces = C.chunks(answer, 16_384)
        await stream.send(*(C.response_body(piece, False) for piece in pieces))
        await stream.send(C.response_body(b"", True))
        back = b""
        while True:
            (msg,) = await stream.read(1)
            streamed = msg.response_body.response.body_mutation.streamed_response
            assert len(streamed.body) <= P.BODY_CHUNK
            back += streamed.body
            if streamed.end_of_stream:
                break
        await stream.close()
    assert back == answer


async def test_a_stream_that_ends_before_the_answer_releases_its_load_as_499() -> None:
    async with sim_pods(1) as pods, running_epp(settings_for(pods)) as (server, ch):
        stream = await pick(ch, chat_body("hello"))
        await stream.read_request_pick()
        load = server.picker.load
        # the load is taken once the pick is on its way (after_send), so it may follow
        # the client's read of the pick by a moment
        await wait_until(
            lambda: load.snapshot_now([pods[0].name])[pods[0].name][0] == 1,  # type: ignore[attr-defined]
            "the picked pod's load taken",
        )
        stream.call.cancel()  # the client went away: Envoy resets the stream
        await wait_until(
            lambda: metric(server, "kvroute_requests_total", status="499") == 1,
            "the aborted request counted as 499",
        )
        assert load.snapshot_now([pods[0].name])[pods[0].name] == (0, 0)  # type: ignore[attr-defined]


async def test_a_request_without_a_body_goes_to_the_least_loaded_pod() -> None:
    async with sim_pods(2) as pods, running_epp(settings_for(pods)) as (_server, ch):
        busy = await pick(ch, chat_body("hello"))  # one request in flight on some pod
        busy_answer, _ = await busy.read_request_pick()
        stream = C.Stream(ch)
        await stream.send(C.request_headers("/v1/models", method="GET", end_of_stream=True))
        (answer,) = await stream.read(1)
        await stream.close()
        await busy.close()
    assert C.destination_metadata(answer) != C.destination_metadata(busy_answer)
    assert "content-length" not in C.set_headers(answer)


async def test_a_stored_response_is_fetched_from_the_pod_that_created_it() -> None:
    async with sim_pods(3) as pods, running_epp(settings_for(pods)) as (_server, ch):
        body = json.dumps({"model": MODEL, "input": "hello"}).encode()
        stream = C.Stream(ch)
        await stream.send(C.request_headers("/v1/responses"), C.request_body(body, True))
        answer, _ = await stream.read_request_pick()
        creator = C.destination_metadata(answer)
        await stream.send(
            C.response_headers(),
            C.response_body(b'{"id": "resp_1", "object": "response"}', True),
        )
        await stream.read(2)
        await stream.close()
        found = []
        for _ in range(3):  # wherever the least-loaded choice would go, it goes there
            get = C.Stream(ch)
            await get.send(
                C.request_headers("/v1/responses/resp_1", method="GET", end_of_stream=True)
            )
            (got,) = await get.read(1)
            await get.close()
            found.append(C.destination_metadata(got))
        unknown = C.Stream(ch)
        await unknown.send(
            C.request_headers("/v1/responses/nope", method="GET", end_of_stream=True)
        )
        (missing,) = await unknown.read(1)
        await unknown.close()
    assert found == [creator] * 3
    assert missing.immediate_response.status.code == 404


async def test_request_trailers_end_the_body_and_are_answered_after_it() -> None:
    async with sim_pods(1) as pods, running_epp(settings_for(pods)) as (_server, ch):
        body = chat_body("hello", stream=True)
        stream = C.Stream(ch)
        await stream.send(
            C.request_headers(CHAT),
            C.request_body(body, False),
            C.ep.ProcessingRequest(request_trailers=C.ep.HttpTrailers()),
        )
        answers = await stream.read(3)
        await stream.close()
    kinds = [a.WhichOneof("response") for a in answers]
    assert kinds == ["request_headers", "request_body", "request_trailers"]
    streamed = answers[1].request_body.response.body_mutation.streamed_response
    assert streamed.body == body and not streamed.end_of_stream


async def test_concurrent_streams_each_get_their_own_pick() -> None:
    async with sim_pods(2) as pods, running_epp(settings_for(pods)) as (_server, ch):

        async def one(i: int) -> str:
            stream = await pick(ch, chat_body(f"conversation {i}", stream=True))
            answer, echoed = await stream.read_request_pick()
            assert echoed == chat_body(f"conversation {i}", stream=True)
            await stream.close()
            return C.destination_metadata(answer)

        picked = await asyncio.gather(*(one(i) for i in range(20)))
    assert set(picked) <= {endpoint(p) for p in pods}
