"""The proxy: retry before the first byte, never after; streaming passthrough; client
disconnect cancels upstream; auth; OpenAI error JSON for upstream failures.

The router runs for real (uvicorn on a free loopback port) in front of small real
HTTP upstreams whose behaviour each test chooses.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from router.config import Settings
from router.fleet.discovery import StaticPod
from router.proxy.app import create_app
from router.proxy.serve import RunningServer
from tests.support.one_pod import one_pod_router
from tests.support.ports import refused_port

MODEL = "m"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}


@dataclass
class Upstream:
    """A fake pod; ``behaviour(request, upstream)`` answers the generation endpoints."""

    name: str
    behaviour: Callable[[Request, Upstream], Any]
    hits: int = 0
    bodies: list[bytes] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    events: dict[str, asyncio.Event] = field(default_factory=dict)

    def event(self, name: str) -> asyncio.Event:
        return self.events.setdefault(name, asyncio.Event())

    def app(self) -> Starlette:
        async def generate(request: Request) -> Response:
            self.hits += 1
            self.bodies.append(await request.body())
            self.headers.append(dict(request.headers))
            result = self.behaviour(request, self)
            if asyncio.iscoroutine(result):
                result = await result
            assert isinstance(result, Response)
            return result

        async def models(request: Request) -> Response:
            return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

        async def health(request: Request) -> Response:
            return Response(b"")

        async def metrics(request: Request) -> Response:
            return Response(b"vllm:num_requests_running 0\n")

        return Starlette(
            routes=[
                Route("/v1/chat/completions", generate, methods=["POST"]),
                Route("/v1/completions", generate, methods=["POST"]),
                Route("/v1/embeddings", generate, methods=["POST"]),
                Route("/v1/models", models),
                Route("/health", health),
                Route("/metrics", metrics),
            ]
        )


def ok(request: Request, up: Upstream) -> Response:
    return JSONResponse({"id": "x", "object": "chat.completion", "served_by": up.name})


def status(code: int) -> Callable[[Request, Upstream], Response]:
    def answer(request: Request, up: Upstream) -> Response:
        return JSONResponse({"error": {"message": f"{up.name} says {code}"}}, status_code=code)

    return answer


@dataclass
class Rig:
    router: RunningServer
    ups: dict[str, Upstream]
    client: httpx.AsyncClient

    async def pick_request_id_for(self, pod: str, body: dict[str, Any]) -> str:
        """A request id the policy routes to ``pod`` first (decisions are deterministic)."""
        for i in range(200):
            rid = f"req-{i}"
            r = await self.client.post("/v1/route", json=body, headers={"x-request-id": rid})
            assert r.status_code == 200, r.text
            if r.json()["pod"] == pod:
                return rid
        raise AssertionError(f"no request id routes to {pod}")


async def _rig(
    behaviours: dict[str, Callable[[Request, Upstream], Any] | None], **overrides: Any
) -> tuple[Rig, list[RunningServer]]:
    servers: list[RunningServer] = []
    ups: dict[str, Upstream] = {}
    static = []
    for name, behaviour in behaviours.items():
        if behaviour is None:  # nothing listens there: connecting fails
            static.append(
                StaticPod(name=name, url=f"http://127.0.0.1:{refused_port()}", models=[MODEL])
            )
            continue
        up = Upstream(name, behaviour)
        srv = await RunningServer(up.app()).start()
        servers.append(srv)
        ups[name] = up
        static.append(StaticPod(name=name, url=srv.url, models=[MODEL]))
    settings = Settings.model_validate(
        {
            "discovery": {"static": [p.model_dump() for p in static]},
            "events": {"enabled": False},
            "health": {"enabled": False},
            "fleet": {"enabled": False},
            **overrides,
        }
    )
    router = await RunningServer(create_app(settings)).start()
    servers.append(router)
    client = httpx.AsyncClient(base_url=router.url, timeout=30)
    return Rig(router, ups, client), servers


@pytest.fixture
async def make_rig() -> AsyncIterator[Callable[..., Any]]:
    started: list[tuple[Rig, list[RunningServer]]] = []

    async def make(
        behaviours: dict[str, Callable[[Request, Upstream], Any] | None], **overrides: Any
    ) -> Rig:
        rig, servers = await _rig(behaviours, **overrides)
        started.append((rig, servers))
        return rig

    yield make
    for rig, servers in started:
        await rig.client.aclose()
        for s in reversed(servers):
            await s.stop()


async def test_non_streaming_answer_is_relayed_with_the_pod_header(make_rig: Any) -> None:
    rig = await make_rig({"a": ok}, proxy={"stream_json_answers": False})
    r = await rig.client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200
    assert r.json()["served_by"] == "a"
    assert r.headers["x-kvroute-pod"] == "a"
    assert rig.ups["a"].bodies == [r.request.content]  # body forwarded byte for byte


async def test_a_json_answer_of_one_token_goes_as_it_came(make_rig: Any) -> None:
    rig = await make_rig({"a": ok})
    r = await rig.client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1})
    assert r.status_code == 200
    assert rig.ups["a"].bodies == [r.request.content]  # its head is its first token


async def test_a_json_answer_is_asked_of_its_pod_as_a_stream_with_its_usage(
    make_rig: Any,
) -> None:
    rig = await make_rig({"a": ok})
    r = await rig.client.post("/v1/chat/completions", json=CHAT)
    sent = json.loads(rig.ups["a"].bodies[0])
    assert sent == {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
    # a pod that answers JSON anyway (not vLLM): its answer is relayed as it came
    assert (r.status_code, r.json()["served_by"]) == (200, "a")


async def test_pod_header_name_is_configurable(make_rig: Any) -> None:
    rig = await make_rig({"a": ok}, pod_header="x-served-by")
    r = await rig.client.post("/v1/chat/completions", json=CHAT)
    assert r.headers["x-served-by"] == "a"
    assert "x-kvroute-pod" not in r.headers


async def test_503_before_any_byte_is_retried_once_on_the_next_best_pod(make_rig: Any) -> None:
    rig = await make_rig({"bad": status(503), "good": ok})
    rid = await rig.pick_request_id_for("bad", CHAT)
    r = await rig.client.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": rid})
    assert r.status_code == 200
    assert r.headers["x-kvroute-pod"] == "good"
    assert rig.ups["bad"].hits == 1 and rig.ups["good"].hits == 1
    metrics = (await rig.client.get("/metrics")).text
    assert 'kvroute_retries_total{reason="status_503"} 1.0' in metrics


async def test_prompt_and_predicted_cached_tokens_after_a_retry_name_the_pod_that_served(
    make_rig: Any,
) -> None:
    rig = await make_rig({"bad": status(503), "good": ok})
    rid = await rig.pick_request_id_for("bad", CHAT)
    r = await rig.client.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": rid})
    assert r.status_code == 200 and r.headers["x-kvroute-pod"] == "good"
    metrics = (await rig.client.get("/metrics")).text
    served = [ln for ln in metrics.splitlines() if ln.startswith("kvroute_prompt_tokens_total{")]
    assert len(served) == 1 and 'pod="good"' in served[0]
    assert float(served[0].split()[1]) > 0
    cached = [
        ln for ln in metrics.splitlines() if ln.startswith("kvroute_predicted_cached_tokens_total{")
    ]
    assert len(cached) == 1 and 'pod="good"' in cached[0]


async def test_502_is_retried_too(make_rig: Any) -> None:
    rig = await make_rig({"bad": status(502), "good": ok})
    rid = await rig.pick_request_id_for("bad", CHAT)
    r = await rig.client.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": rid})
    assert r.status_code == 200 and r.headers["x-kvroute-pod"] == "good"


async def test_connect_failure_is_retried_on_the_next_best_pod(make_rig: Any) -> None:
    rig = await make_rig({"down": None, "good": ok})
    rid = await rig.pick_request_id_for("down", CHAT)
    r = await rig.client.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": rid})
    assert r.status_code == 200
    assert r.headers["x-kvroute-pod"] == "good"
    metrics = (await rig.client.get("/metrics")).text
    assert 'kvroute_upstream_errors_total{pod="down",reason="connect"} 1.0' in metrics


async def test_only_one_retry_then_the_last_answer_is_passed_through(make_rig: Any) -> None:
    rig = await make_rig({"a": status(503), "b": status(503), "c": status(503)})
    r = await rig.client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 503
    assert sum(u.hits for u in rig.ups.values()) == 2  # first try + one retry


async def test_all_pods_unreachable_gives_502_openai_error(make_rig: Any) -> None:
    rig = await make_rig({"x": None, "y": None})
    r = await rig.client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 502
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "upstream_error" and "cannot connect" in err["message"]


async def test_other_5xx_is_not_retried(make_rig: Any) -> None:
    rig = await make_rig({"bad": status(500), "good": ok})
    rid = await rig.pick_request_id_for("bad", CHAT)
    r = await rig.client.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": rid})
    assert r.status_code == 500
    assert rig.ups["good"].hits == 0


async def _stream_then_break(request: Request, up: Upstream) -> Response:
    async def body() -> AsyncIterator[bytes]:
        yield b'data: {"first": true}\n\n'
        await asyncio.sleep(0.05)
        raise RuntimeError("pod crashed mid-stream")

    return StreamingResponse(body(), media_type="text/event-stream")


async def test_no_retry_after_bytes_went_out(make_rig: Any) -> None:
    rig = await make_rig({"breaks": _stream_then_break, "good": ok})
    body = {**CHAT, "stream": True}
    rid = await rig.pick_request_id_for("breaks", body)
    received = b""
    with pytest.raises(httpx.HTTPError):  # the stream ends abruptly, as upstream's did
        async with rig.client.stream(
            "POST", "/v1/chat/completions", json=body, headers={"x-request-id": rid}
        ) as r:
            assert r.status_code == 200
            async for chunk in r.aiter_raw():
                received += chunk
    assert received.startswith(b'data: {"first": true}')
    assert rig.ups["good"].hits == 0


async def _slow_stream(request: Request, up: Upstream) -> Response:
    release = up.event("release")
    cancelled = up.event("cancelled")

    async def body() -> AsyncIterator[bytes]:
        try:
            yield b"data: one\n\n"
            await release.wait()  # the rest is held back until the test says so
            yield b"data: two\n\n"
            yield b"data: [DONE]\n\n"
        except asyncio.CancelledError:
            cancelled.set()
            raise

    return StreamingResponse(body(), media_type="text/event-stream")


async def test_streaming_chunks_arrive_before_the_upstream_finished(make_rig: Any) -> None:
    rig = await make_rig({"a": _slow_stream})
    up = rig.ups["a"]
    async with rig.client.stream(
        "POST", "/v1/chat/completions", json={**CHAT, "stream": True}
    ) as r:
        assert r.headers["x-kvroute-pod"] == "a"
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks = r.aiter_raw()
        first = await chunks.__anext__()
        # the upstream has not finished (it waits for `release`), yet the chunk is here
        assert first == b"data: one\n\n"
        assert not up.event("release").is_set()
        up.event("release").set()
        rest = b"".join([c async for c in chunks])
    assert rest == b"data: two\n\ndata: [DONE]\n\n"
    metrics = (await rig.client.get("/metrics")).text
    assert 'kvroute_ttft_seconds_count{model="m",pod="a"} 1.0' in metrics


async def test_an_error_answer_to_a_stream_times_no_first_token(make_rig: Any) -> None:
    """A pod's 400 to a streaming request is relayed, but its body is no first token:
    no TTFT, and the policy learns nothing from it (bad requests would teach it that
    prefill is instant)."""
    rig = await make_rig({"a": status(400)})
    heard: list[float] = []
    app: Any = rig.router.server.config.app
    policy = app.state.gateway.policy
    hook = policy.on_first_token

    def recorded(request: Any, pod: str, ttft_s: float) -> None:
        heard.append(ttft_s)
        hook(request, pod, ttft_s)

    policy.on_first_token = recorded
    r = await rig.client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["message"] == "a says 400"
    metrics = (await rig.client.get("/metrics")).text
    assert "kvroute_ttft_seconds_count" not in metrics and heard == []


async def test_client_disconnect_mid_stream_cancels_the_upstream_request(make_rig: Any) -> None:
    rig = await make_rig({"a": _slow_stream})
    up = rig.ups["a"]
    async with rig.client.stream(
        "POST", "/v1/chat/completions", json={**CHAT, "stream": True}
    ) as r:
        await r.aiter_raw().__anext__()
    # the client closed its connection: the router must close the upstream one
    await asyncio.wait_for(up.event("cancelled").wait(), timeout=10)
    await _until_inflight_zero(rig, "a")


async def _slow_json(request: Request, up: Upstream) -> Response:
    up.event("started").set()
    while not await request.is_disconnected():
        await asyncio.sleep(0.01)
    up.event("cancelled").set()
    return Response(b"", status_code=499)


async def test_client_disconnect_while_waiting_cancels_a_non_streaming_request(
    make_rig: Any,
) -> None:
    rig = await make_rig({"a": _slow_json})
    up = rig.ups["a"]
    task = asyncio.create_task(rig.client.post("/v1/chat/completions", json=CHAT))
    await asyncio.wait_for(up.event("started").wait(), timeout=10)
    task.cancel()  # the client gives up: its connection closes
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.wait_for(up.event("cancelled").wait(), timeout=10)
    await _until_inflight_zero(rig, "a")


async def _until_inflight_zero(rig: Rig, pod: str) -> None:
    """The router released the pod's in-flight slot (polls /metrics, generous deadline)."""
    needle = f'kvroute_inflight_requests{{pod="{pod}"}} 0.0'
    for _ in range(500):
        if needle in (await rig.client.get("/metrics")).text:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"in-flight of {pod} never returned to 0")


async def test_authorization_is_passed_through_without_router_keys(make_rig: Any) -> None:
    rig = await make_rig({"a": ok})
    await rig.client.post(
        "/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer pod-key"}
    )
    assert rig.ups["a"].headers[0]["authorization"] == "Bearer pod-key"


async def test_router_api_keys_reject_wrong_keys_with_401(make_rig: Any) -> None:
    rig = await make_rig({"a": ok}, api_keys=["s3cret"])
    r = await rig.client.post(
        "/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer nope"}
    )
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"
    r = await rig.client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 401
    assert rig.ups["a"].hits == 0
    r = await rig.client.post(
        "/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer s3cret"}
    )
    assert r.status_code == 200
    # the router's own key is not leaked to the pod
    assert "authorization" not in rig.ups["a"].headers[0]


async def test_body_over_the_limit_is_413(make_rig: Any) -> None:
    rig = await make_rig({"a": ok}, proxy={"max_body_bytes": 2048})
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 4096}]}
    r = await rig.client.post("/v1/chat/completions", json=big)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "body_too_large"
    assert rig.ups["a"].hits == 0


async def test_embeddings_are_passed_through(make_rig: Any) -> None:
    rig = await make_rig({"a": ok})
    r = await rig.client.post("/v1/embeddings", json={"model": MODEL, "input": "hi"})
    assert r.status_code == 200 and r.headers["x-kvroute-pod"] == "a"
    assert b'"input"' in rig.ups["a"].bodies[0]


async def test_a_pod_answering_garbage_gives_502_openai_error() -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"this is not HTTP\r\n\r\n")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(garbage, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with one_pod_router("g", f"http://127.0.0.1:{port}", MODEL) as (_, client):
            r = await client.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 502
            assert r.json()["error"]["type"] == "upstream_error"
            assert r.headers["x-kvroute-pod"] == "g"
            metrics = (await client.get("/metrics")).text
            assert 'kvroute_upstream_errors_total{pod="g",reason="transport"} 1.0' in metrics
    finally:
        server.close()
        await server.wait_closed()


# -- the pod transport on raw sockets ---------------------------------------------------------


async def _raw_pod(answer: Callable[[int], bytes | None]) -> tuple[asyncio.Server, int, list[int]]:
    """A pod on a raw socket: each request (head + Content-Length body) on connection
    number ``n`` is answered with ``answer(n)`` bytes (None: say nothing, hold the
    connection); a trailing ``b"<close>"`` marker closes the connection after writing."""
    connections: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        n = len(connections)
        connections.append(0)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        await reader.readexactly(int(line.split(b":")[1]))
                connections[n] += 1
                out = answer(n)
                if out is None:
                    await asyncio.sleep(30)
                    return
                close = out.endswith(b"<close>")
                writer.write(out.removesuffix(b"<close>"))
                await writer.drain()
                if close:
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], connections


def _post(port: int) -> bytes:
    return (
        f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-length: 2\r\n\r\n"
    ).encode()


async def test_transport_redials_when_the_pod_closed_the_idle_keepalive_connection() -> None:
    from router.fleet.transport import PodTransport

    # answers, then closes the connection although it promised keep-alive
    ok_then_close = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok<close>"
    server, port, conns = await _raw_pod(lambda n: ok_then_close)
    transport = PodTransport()
    try:
        for _ in range(3):
            up = await transport.send_raw("127.0.0.1", port, _post(port), b"{}", 2.0, 5.0)
            assert up.status == 200
            assert await up.stream.read_all() == b"ok"
            await up.stream.aclose()
            await asyncio.sleep(0.05)  # the pod's FIN arrives while the connection idles
        assert conns == [1, 1, 1]  # every request got an answer, each on a fresh dial
    finally:
        await transport.aclose()
        server.close()
        await server.wait_closed()


async def test_transport_reuses_a_keepalive_connection() -> None:
    from router.fleet.transport import PodTransport

    server, port, conns = await _raw_pod(
        lambda n: b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nhello"
    )
    transport = PodTransport()
    try:
        for _ in range(3):
            up = await transport.send_raw("127.0.0.1", port, _post(port), b"{}", 2.0, 5.0)
            assert await up.stream.read_all() == b"hello"
            await up.stream.aclose()
        assert conns == [3]
    finally:
        await transport.aclose()
        server.close()
        await server.wait_closed()


async def test_transport_reads_chunked_and_close_delimited_bodies_whole() -> None:
    from router.fleet.transport import PodTransport

    answers = [
        b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
        b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{"until": "close"}<close>',
    ]
    server, port, conns = await _raw_pod(lambda n: answers[0])
    transport = PodTransport()
    try:
        up = await transport.send_raw("127.0.0.1", port, _post(port), b"{}", 2.0, 5.0)
        assert await up.stream.read_all() == b"abcde"
        await up.stream.aclose()
        up = await transport.send_raw("127.0.0.1", port, _post(port), b"{}", 2.0, 5.0)
        assert await up.stream.read_all() == b"abcde"
        await up.stream.aclose()
        assert conns == [2]  # a chunked body read to its end leaves the connection usable
        server2, port2, _ = await _raw_pod(lambda n: answers[1])
        try:
            up = await transport.send_raw("127.0.0.1", port2, _post(port2), b"{}", 2.0, 5.0)
            assert await up.stream.read_all() == b'{"until": "close"}'
            await up.stream.aclose()
        finally:
            server2.close()
            await server2.wait_closed()
    finally:
        await transport.aclose()
        server.close()
        await server.wait_closed()


async def test_transport_reads_a_body_larger_than_the_pause_threshold_whole() -> None:
    """Reading from the pod pauses above PAUSE_ABOVE buffered bytes; a whole-body read
    takes what is buffered and reads on (it used to wait for the read timeout)."""
    from router.fleet.pod_connection import PAUSE_ABOVE
    from router.fleet.transport import PodTransport

    body = bytes(range(256)) * ((3 * PAUSE_ABOVE) // 256)
    head = b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body)
    server, port, _ = await _raw_pod(lambda n: head + body)
    transport = PodTransport()
    try:
        up = await transport.send_raw("127.0.0.1", port, _post(port), b"{}", 2.0, 30.0)
        assert await up.stream.read_all() == body
        await up.stream.aclose()
    finally:
        await transport.aclose()
        server.close()
        await server.wait_closed()


async def test_a_pod_that_sends_nothing_within_the_read_timeout_gives_504() -> None:
    server, port, _ = await _raw_pod(lambda n: None)
    url = f"http://127.0.0.1:{port}"
    try:
        async with one_pod_router("slow", url, MODEL, proxy={"read_timeout_s": 0.3}) as (_, client):
            r = await client.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 504
            assert r.json()["error"]["code"] == "upstream_timeout"
            metrics = (await client.get("/metrics")).text
            assert 'kvroute_upstream_errors_total{pod="slow",reason="timeout"} 1.0' in metrics
    finally:
        server.close()
        await server.wait_closed()
