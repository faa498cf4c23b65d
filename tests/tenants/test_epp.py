"""The Endpoint Picker front applies the same tenant rules: the key, the model, the
limits, and the tenant's cache_salt set in the body it sends back to the proxy."""

from __future__ import annotations

import json
import re

import grpc
import httpx

from router.epp import protocol as P
from tests.epp import client as C
from tests.epp.fleet import MODEL, endpoint, running_epp, settings_for, sim_pods
from tests.support.aio import wait_until
from tests.tenants.rig import KEY_A, two_tenants

CHAT = "/v1/chat/completions"


def body(**kw: object) -> bytes:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **kw}
    return json.dumps(payload).encode()


async def pick(channel: grpc.aio.Channel, raw: bytes, key: str | None) -> tuple[object, bytes]:
    stream = C.Stream(channel)
    extra = [("authorization", f"Bearer {key}")] if key else []
    await stream.send(C.request_headers(CHAT, extra=extra), C.request_body(raw, True))
    answer, echoed = await stream.read_request_pick()
    await stream.close()
    return answer, echoed


async def test_the_epp_sets_the_tenants_salt_over_the_clients_and_refuses_bad_keys() -> None:
    limits = {"requests_per_minute": 2}
    async with (
        sim_pods(1) as pods,
        running_epp(settings_for(pods, **two_tenants(limits=limits, models=[MODEL]))) as (
            server,
            channel,
        ),
    ):
        salt = server.picker.tenants.tenancy.context("a").salt  # type: ignore[union-attr]
        answer, echoed = await pick(channel, body(cache_salt="mine"), KEY_A)
        assert json.loads(echoed)["cache_salt"] == salt
        assert C.set_headers(answer)["content-length"] == str(len(echoed))
        refused, _ = await pick(channel, body(), "wrong-key")
        assert refused.immediate_response.status.code == 401  # type: ignore[attr-defined]
        await pick(channel, body(), KEY_A)
        limited, _ = await pick(channel, body(), KEY_A)
        imm = limited.immediate_response  # type: ignore[attr-defined]
        assert imm.status.code == 429
        assert json.loads(imm.body)["error"]["type"] == "rate_limit_error"
        assert any(h.header.key == "retry-after" for h in imm.headers.set_headers)
        assert P.DESTINATION_KEY in C.set_headers(answer)


async def test_a_model_the_tenant_may_not_use_is_an_immediate_404() -> None:
    async with (
        sim_pods(1, model="other") as pods,
        running_epp(settings_for(pods, **two_tenants(models=[MODEL]))) as (_server, channel),
    ):
        hidden, _ = await pick(channel, body(model="other"), KEY_A)
        imm = hidden.immediate_response  # type: ignore[attr-defined]
        assert imm.status.code == 404
        assert json.loads(imm.body)["error"]["code"] == "model_not_found"


async def test_no_healthy_pod_is_an_immediate_503_that_names_no_pod_address() -> None:
    health = {"enabled": True, "interval_s": 0.1, "timeout_s": 0.2, "failure_threshold": 1}
    async with sim_pods(1) as pods:
        url = pods[0].url
        # named by its address, as DNS discovery names pods: a name in a message leaks it
        static = [{"name": endpoint(pods[0]), "url": url, "models": [MODEL]}]
        settings = settings_for(pods, health=health, **two_tenants())
        settings = settings.model_copy(
            update={"discovery": settings.discovery.model_validate({"static": static})}
        )
        await pods[0].stop()  # its health checks now fail: ejected
        async with running_epp(settings) as (server, channel):

            async def ejected() -> bool:
                return not any(p.healthy for p in server.picker.registry.all())

            await wait_until(ejected, timeout=10)
            answer, _ = await pick(channel, body(), KEY_A)
    imm = answer.immediate_response  # type: ignore[attr-defined]
    assert imm.status.code == 503
    error = json.loads(imm.body)["error"]
    assert error["code"] == "no_healthy_pod"
    text = imm.body.decode()
    assert "127.0.0.1:" not in text and url not in text, text


async def test_a_tenant_stream_without_include_usage_is_charged_and_relayed_as_it_would_be() -> (
    None
):
    """Envoy's part played here: the body the EPP sends on goes to a real sim pod, whose
    stream is fed back chunk by chunk; what the EPP sends back is what the pod sends a
    client that did not ask for usage, and the completion tokens are counted."""
    chat_body = body(max_tokens=24, stream=True)
    async with (
        sim_pods(1) as pods,
        running_epp(settings_for(pods, **two_tenants())) as (server, channel),
        httpx.AsyncClient(timeout=30) as direct,
    ):
        plain = await direct.post(pods[0].url + CHAT, content=chat_body)
        stream = C.Stream(channel)
        extra = [("authorization", f"Bearer {KEY_A}")]
        await stream.send(C.request_headers(CHAT, extra=extra), C.request_body(chat_body, True))
        _, sent = await stream.read_request_pick()
        assert json.loads(sent)["stream_options"] == {"include_usage": True}
        asked = await direct.post(pods[0].url + CHAT, content=sent)
        assert b'"usage"' in asked.content
        pieces = C.chunks(asked.content, 100)
        await stream.send(C.response_headers(200, "text/event-stream"))
        await stream.read(1)
        relayed = b""
        for i, piece in enumerate(pieces):
            await stream.send(C.response_body(piece, i == len(pieces) - 1))
            [answer] = await stream.read(1)
            relayed += answer.response_body.response.body_mutation.streamed_response.body
        await stream.close()
        registry = server.picker.metrics.registry

        async def charged() -> bool:
            labels = {"tenant": "a", "kind": "completion"}
            return registry.get_sample_value("kvroute_tenant_tokens_total", labels) == 24

        await wait_until(charged, timeout=5)
    volatile = re.compile(rb'"(id|created)":("[^"]*"|\d+)')
    assert b'"usage"' not in relayed
    assert volatile.sub(b"", relayed) == volatile.sub(b"", plain.content)


async def picked(channel: grpc.aio.Channel) -> C.Stream:
    """Tenant A's chat request, picked: the stream, its response to come."""
    stream = C.Stream(channel)
    extra = [("authorization", f"Bearer {KEY_A}")]
    await stream.send(C.request_headers(CHAT, extra=extra), C.request_body(body(), True))
    await stream.read_request_pick()
    return stream


async def test_a_pods_5xx_body_is_replaced_by_an_error_that_names_no_pod_address() -> None:
    async with (
        sim_pods(1) as pods,
        running_epp(settings_for(pods, **two_tenants())) as (_server, channel),
    ):
        stream = await picked(channel)
        pod_body = json.dumps({"error": f"engine at {pods[0].url} crashed"}).encode()
        await stream.send(C.response_headers(500, "application/json"))
        [head] = await stream.read(1)
        relayed = b""
        for i, piece in enumerate(pieces := C.chunks(pod_body, 20)):
            await stream.send(C.response_body(piece, i == len(pieces) - 1))
            [answer] = await stream.read(1)
            relayed += answer.response_body.response.body_mutation.streamed_response.body
        await stream.close()
    headers = C.set_headers(head, "response_headers")
    assert "x-kvroute-pod" not in headers  # an error names no pod
    assert headers["content-length"] == str(len(relayed))
    assert headers["content-type"] == "application/json"
    error = json.loads(relayed)["error"]
    assert error["code"] == "status_500"
    assert "127.0.0.1:" not in relayed.decode() and "crashed" not in relayed.decode()


async def test_a_tenant_s_json_answer_with_no_whole_stream_is_a_502_that_names_no_pod() -> None:
    async with (
        sim_pods(1) as pods,
        running_epp(settings_for(pods, **two_tenants())) as (_server, channel),
    ):
        stream = await picked(channel)
        await stream.send(C.response_headers(200, "text/event-stream"))
        failed = f'data: {{"error": {{"message": "engine at {pods[0].url} died"}}}}\n\n'
        await stream.send(C.response_body(failed.encode(), True))
        [answer] = await stream.read(1)
        await stream.close()
    immediate = answer.immediate_response
    headers = {h.header.key for h in immediate.headers.set_headers}
    assert immediate.status.code == 502
    assert "x-kvroute-pod" not in headers  # an error names no pod
    assert json.loads(immediate.body)["error"]["code"] == "stream_error"
    assert b"127.0.0.1:" not in immediate.body and b"died" not in immediate.body
