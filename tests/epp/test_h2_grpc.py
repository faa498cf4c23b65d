"""kvroute's own gRPC server (router/epp/h2_grpc.py), spoken to by grpcio's client (an
independent HTTP/2 and gRPC implementation) over loopback: messages both ways, flow
control with messages far larger than the peer's windows, errors as gRPC statuses,
health Watch, and a graceful stop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.epp import h2_grpc
from router.epp.fronts import PROCESS_METHOD, H2Front
from tests.epp.fleet import running_epp, settings_for, sim_pods

ECHO = "/test.Echo/Echo"


async def _echo(call: h2_grpc.Call) -> None:
    """Every request body back as a response body, the same bytes; a body ``slow``
    waits 0.3 s first."""
    while (req := await call.read()) is not None:
        if req.request_body.body == b"slow":
            await asyncio.sleep(0.3)
        call.write(
            ep.ProcessingResponse(
                request_body=ep.BodyResponse(
                    response=ep.CommonResponse(
                        body_mutation=ep.BodyMutation(body=req.request_body.body)
                    )
                )
            )
        )


async def _first_only(call: h2_grpc.Call) -> None:
    """Reads one message and answers 0.2 s later, while the client goes on sending."""
    await call.read()
    await asyncio.sleep(0.2)
    call.write(ep.ProcessingResponse())


async def _fails(call: h2_grpc.Call) -> None:
    await call.read()
    raise RuntimeError("a bug")


@contextlib.asynccontextmanager
async def echo_server() -> AsyncIterator[tuple[h2_grpc.H2GrpcServer, grpc.aio.Channel]]:
    server = h2_grpc.H2GrpcServer(
        {
            ECHO: h2_grpc.Method(_echo, ep.ProcessingRequest),
            "/test.Echo/Fails": h2_grpc.Method(_fails, ep.ProcessingRequest),
            "/test.Echo/FirstOnly": h2_grpc.Method(_first_only, ep.ProcessingRequest),
        }
    )
    port = await server.start("127.0.0.1", 0)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield server, channel
    finally:
        await server.stop(0.5)


def body(data: bytes) -> ep.ProcessingRequest:
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=data))


def _method(channel: grpc.aio.Channel, path: str) -> grpc.aio.StreamStreamMultiCallable:
    return channel.stream_stream(
        path,
        request_serializer=ep.ProcessingRequest.SerializeToString,
        response_deserializer=ep.ProcessingResponse.FromString,
    )


async def test_messages_far_larger_than_the_windows_go_both_ways_byte_for_byte() -> None:
    # grpcio's client starts with 64 KiB windows: 3 MB each way waits for WINDOW_UPDATEs
    sizes = [1, 70_000, 3_000_000, 0, 200_000]
    payloads = [bytes([i % 251]) * n for i, n in enumerate(sizes)]
    async with echo_server() as (_, channel):
        answers = [
            r.request_body.response.body_mutation.body
            async for r in _method(channel, ECHO)(body(p) for p in payloads)
        ]
    assert answers == payloads


async def test_concurrent_calls_on_one_connection_each_get_their_own_answers() -> None:
    async with echo_server() as (_, channel):

        async def one(i: int) -> list[bytes]:
            msgs = [body(f"{i}-{j}".encode() * (1 + 5000 * (j % 2))) for j in range(4)]
            return [
                r.request_body.response.body_mutation.body
                async for r in _method(channel, ECHO)(iter(msgs))
            ]

        results = await asyncio.gather(*(one(i) for i in range(30)))
    for i, answers in enumerate(results):
        assert answers == [f"{i}-{j}".encode() * (1 + 5000 * (j % 2)) for j in range(4)]


async def test_what_a_call_leaves_unread_is_acknowledged_and_the_connection_keeps_flowing() -> None:
    # each call ends after its first message while its client sends ~12 MB: what arrives
    # after the end must still be acknowledged, or the connection's 8 MiB window would
    # close for good after a few such calls
    big = body(b"x" * 400_000)
    async with echo_server() as (_, channel):
        for _ in range(4):
            call = _method(channel, "/test.Echo/FirstOnly")(iter([big] * 30), timeout=10)
            try:
                async for _answer in call:
                    pass
            except grpc.aio.AioRpcError as err:
                # grpcio's client reports its own send cut short by the status as INTERNAL;
                # a window closed for good would be DEADLINE_EXCEEDED
                assert err.code() == grpc.StatusCode.INTERNAL, err
        after = [
            r.request_body.response.body_mutation.body
            async for r in _method(channel, ECHO)(iter([big]), timeout=10)
        ]
    assert after == [big.request_body.body]


async def test_an_unknown_method_is_unimplemented_and_a_failing_handler_unknown() -> None:
    async with echo_server() as (_, channel):

        def unary(path: str) -> grpc.aio.UnaryUnaryMultiCallable:
            # (a unary call sends its message with its headers: a status that comes
            # back before a streamed message went would be reported by the client as its
            # own failure to send)
            return channel.unary_unary(
                path,
                request_serializer=ep.ProcessingRequest.SerializeToString,
                response_deserializer=ep.ProcessingResponse.FromString,
            )

        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await unary("/test.Echo/Nope")(body(b"x"))
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await unary("/test.Echo/Fails")(body(b"x"))
        still = [r async for r in _method(channel, ECHO)(iter([body(b"after")]))]
    assert unknown.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert failed.value.code() == grpc.StatusCode.UNKNOWN
    assert len(still) == 1  # the connection still serves


async def test_a_message_that_does_not_parse_fails_its_call_with_internal() -> None:
    async with echo_server() as (_, channel):
        raw = channel.unary_unary(
            ECHO, request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await raw(b"\xff\xff\xff")
        still = [r async for r in _method(channel, ECHO)(iter([body(b"after")]))]
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert "parse" in (err.value.details() or "")
    assert len(still) == 1


async def test_a_stop_lets_an_open_call_finish_within_its_grace_and_refuses_new_ones() -> None:
    async with echo_server() as (server, channel):
        call = _method(channel, ECHO)(iter([body(b"slow")]))
        await asyncio.sleep(0.1)  # the call is open, its handler sleeping
        stopping = asyncio.create_task(server.stop(5.0))
        await asyncio.sleep(0.05)
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            async for _ in _method(channel, ECHO)(iter([body(b"late")]), timeout=2):
                pass
        answers = [r.request_body.response.body_mutation.body async for r in call]
        await stopping
    assert answers == [b"slow"]
    assert refused.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


async def test_health_watch_streams_each_change_of_a_service() -> None:
    front = H2Front(None, "127.0.0.1", 0)  # type: ignore[arg-type]  # health only
    await front.set_health("readiness", health_pb2.HealthCheckResponse.NOT_SERVING)
    await front.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{front.port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            watch = stub.Watch(health_pb2.HealthCheckRequest(service="readiness"))
            seen = [(await watch.read()).status]
            await front.set_health("readiness", health_pb2.HealthCheckResponse.SERVING)
            seen.append((await watch.read()).status)
            watch.cancel()
            with pytest.raises(grpc.aio.AioRpcError) as unknown:
                await stub.Check(health_pb2.HealthCheckRequest(service="nope"))
    finally:
        await front.stop(0.5)
    assert seen == [
        health_pb2.HealthCheckResponse.NOT_SERVING,
        health_pb2.HealthCheckResponse.SERVING,
    ]
    assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


async def test_the_picker_on_h2_answers_its_health_and_ext_proc_method() -> None:
    async with sim_pods(1) as pods, running_epp(settings_for(pods)) as (server, channel):
        stub = health_pb2_grpc.HealthStub(channel)
        ready = await stub.Check(health_pb2.HealthCheckRequest(service="readiness"))
        process = channel.stream_stream(
            PROCESS_METHOD,
            request_serializer=ep.ProcessingRequest.SerializeToString,
            response_deserializer=ep.ProcessingResponse.FromString,
        )
        # request headers that end the request: picked at once (least loaded)
        headers = ep.ProcessingRequest(request_headers=ep.HttpHeaders(end_of_stream=True))
        answers = [r async for r in process(iter([headers]))]
    assert isinstance(server.front, H2Front)
    assert ready.status == health_pb2.HealthCheckResponse.SERVING
    assert [a.WhichOneof("response") for a in answers] == ["request_headers"]
