"""What a client may send `kvroute serve`: JSON nested too deep (400), request heads too
large or with too many headers (431), idle connections (closed), heads and bodies that
stop or trickle (408, closed); each refusal counted, and logged once per reason and
interval however many there are.

The router runs for real (uvicorn, our HTTP protocol) in front of a simulated pod on
loopback; the clients are raw sockets, so the bytes on the wire are the test's.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from router.config import Settings
from router.fleet.embedded import start_pods, static_pods, stop_pods
from router.proxy.app import create_app
from router.proxy.gateway import Gateway
from router.proxy.serve import RunningServer
from router.sim.settings import SimSettings

MODEL = "sim-model"
GUARD_S = 20.0  # only a guard against hangs, never a speed claim


@contextlib.asynccontextmanager
async def router(**proxy: Any) -> AsyncIterator[tuple[Gateway, RunningServer]]:
    pods = await start_pods([SimSettings(pod_name="sim-0", time_scale=0, kv_events=False)])
    settings = Settings.model_validate(
        {
            "discovery": {"static": [p.model_dump() for p in static_pods(pods)]},
            "events": {"enabled": False},
            "fleet": {"enabled": False},
            "health": {"enabled": False},
            "proxy": proxy,
        }
    )
    app = create_app(settings)
    try:
        async with RunningServer(app) as server:
            yield app.state.gateway, server
    finally:
        await stop_pods(pods)


def refused(gateway: Gateway, reason: str) -> float:
    value = gateway.metrics.registry.get_sample_value(
        "kvroute_bad_requests_total", {"reason": reason}
    )
    return value or 0.0


def forwarded(gateway: Gateway) -> float:
    total = 0.0
    for metric in gateway.metrics.registry.collect():
        if metric.name == "kvroute_requests":
            total += sum(s.value for s in metric.samples if s.name.endswith("_total"))
    return total


def chat_body(**extra: Any) -> bytes:
    return json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}
    ).encode()


def head(path: str, length: int, *headers: str) -> bytes:
    lines = [
        f"POST {path} HTTP/1.1",
        "host: router",
        "content-type: application/json",
        f"content-length: {length}",
        *headers,
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def exchange(server: RunningServer, data: bytes) -> tuple[int, dict[str, Any], bytes]:
    """Send ``data``; -> (status, JSON body or {}, everything read until the server
    closed the connection or one response was complete)."""
    reader, writer = await asyncio.open_connection(server.host, server.port)
    try:
        writer.write(data)
        await writer.drain()
        raw = await asyncio.wait_for(read_response(reader), GUARD_S)
    finally:
        writer.close()
    status = int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/1.1") else 0
    _, _, payload = raw.partition(b"\r\n\r\n")
    try:
        body = json.loads(payload) if payload else {}
    except ValueError:
        body = {}
    return status, body, raw


async def read_response(reader: asyncio.StreamReader) -> bytes:
    """One response with a Content-Length (or all bytes until the server closes)."""
    raw = b""
    while b"\r\n\r\n" not in raw:
        chunk = await reader.read(65536)
        if not chunk:
            return raw
        raw += chunk
    head_part, _, rest = raw.partition(b"\r\n\r\n")
    length = 0
    for line in head_part.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(rest) < length:
        chunk = await reader.read(65536)
        if not chunk:
            break
        rest += chunk
    return head_part + b"\r\n\r\n" + rest


async def closed_by_server(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection."""
    out = b""
    while chunk := await asyncio.wait_for(reader.read(65536), GUARD_S):
        out += chunk
    return out


# -- JSON depth ----------------------------------------------------------------------------


def nested(depth: int) -> str:
    """A JSON value of ``depth`` nested arrays (depth 1: ``[]``)."""
    return "[" * depth + "]" * depth


@pytest.mark.parametrize("depth", [128, 5000, 100_000])
async def test_json_nested_deeper_than_the_limit_is_400_naming_the_limit(depth: int) -> None:
    # the object holding "x" is level 1: its value nests 127 more levels -> 128 in all
    body = ('{"model": "sim-model", "prompt": "hi", "x": ' + nested(depth) + "}").encode()
    async with router() as (gateway, server):
        status, err, _ = await exchange(server, head("/v1/completions", len(body)) + body)
        assert status == 400
        assert err["error"]["code"] == "invalid_json"
        assert "deeper than 128 levels (proxy.max_json_depth)" in err["error"]["message"]
        assert refused(gateway, "invalid_json") == 1
        assert forwarded(gateway) == 0


async def test_json_nested_as_deep_as_the_limit_is_routed() -> None:
    body = ('{"model": "sim-model", "prompt": "hi", "x": ' + nested(127) + "}").encode()
    async with router() as (_, server):
        status, answer, _ = await exchange(server, head("/v1/completions", len(body)) + body)
        assert status == 200, answer
        assert answer["object"] == "text_completion"


async def test_the_depth_limit_is_a_setting_and_applies_to_route_too() -> None:
    body = ('{"model": "sim-model", "prompt": "hi", "x": ' + nested(10) + "}").encode()
    async with router(max_json_depth=8) as (gateway, server):
        for path in ("/v1/completions", "/v1/route"):
            status, err, _ = await exchange(server, head(path, len(body)) + body)
            assert status == 400, path
            assert "deeper than 8 levels" in err["error"]["message"]
        assert refused(gateway, "invalid_json") == 2


# -- request heads -------------------------------------------------------------------------


async def test_a_request_head_over_64_kib_is_431_and_never_forwarded() -> None:
    body = chat_body()
    big = "x-big: " + "a" * (70 * 1024)
    async with router() as (gateway, server):
        status, err, raw = await exchange(
            server, head("/v1/chat/completions", len(body), big) + body
        )
        assert status == 431
        assert b"connection: close" in raw.lower()
        assert err["error"]["code"] == "headers_too_large"
        assert "65536 bytes (proxy.max_header_bytes)" in err["error"]["message"]
        assert refused(gateway, "headers_too_large") == 1
        assert forwarded(gateway) == 0
        # a head just under the limit is served
        ok = "x-ok: " + "a" * (60 * 1024)
        status, answer, _ = await exchange(
            server, head("/v1/chat/completions", len(body), ok) + body
        )
        assert status == 200, answer


async def test_a_head_that_never_ends_is_refused_once_it_passes_the_limit() -> None:
    async with router(max_header_bytes=4096) as (gateway, server):
        reader, writer = await asyncio.open_connection(server.host, server.port)
        raw = b""
        try:
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: r\r\nx-endless: ")
            for _ in range(64):  # up to 128 KiB of one header value, 2 KiB a write, no end
                try:
                    writer.write(b"a" * 2048)
                    await writer.drain()
                    raw += await asyncio.wait_for(reader.read(65536), 0.05)
                except TimeoutError:
                    continue
                except ConnectionError:
                    break
                if raw or reader.at_eof():
                    break
        finally:
            writer.close()
        assert refused(gateway, "headers_too_large") == 1
        assert raw.startswith(b"HTTP/1.1 431 ")
        assert b"4096 bytes" in raw


async def test_more_than_100_headers_is_431() -> None:
    body = chat_body()
    many = [f"x-h{i}: {i}" for i in range(101)]
    async with router() as (gateway, server):
        status, err, _ = await exchange(
            server, head("/v1/chat/completions", len(body), *many) + body
        )
        assert status == 431
        assert err["error"]["code"] == "too_many_headers"
        assert "more than 100 request headers (proxy.max_headers)" in err["error"]["message"]
        assert refused(gateway, "too_many_headers") == 1
        assert forwarded(gateway) == 0
        status, _, _ = await exchange(
            server, head("/v1/chat/completions", len(body), *many[:90]) + body
        )
        assert status == 200


# -- idle and slow clients -----------------------------------------------------------------


async def test_a_connection_that_never_sends_a_request_is_closed() -> None:
    async with router(client_keepalive_timeout_s=0.3) as (gateway, server):
        reader, writer = await asyncio.open_connection(server.host, server.port)
        try:
            assert await closed_by_server(reader) == b""  # closed, without an answer
        finally:
            writer.close()
        assert refused(gateway, "header_timeout") == 0


async def test_an_idle_keepalive_connection_is_closed_after_its_request() -> None:
    body = chat_body()
    async with router(client_keepalive_timeout_s=0.3) as (_, server):
        reader, writer = await asyncio.open_connection(server.host, server.port)
        try:
            writer.write(head("/v1/chat/completions", len(body)) + body)
            raw = await asyncio.wait_for(read_response(reader), GUARD_S)
            assert raw.startswith(b"HTTP/1.1 200 ")
            assert await closed_by_server(reader) == b""
        finally:
            writer.close()


async def test_a_head_that_stops_half_way_is_408_and_closed() -> None:
    async with router(client_header_timeout_s=0.3) as (gateway, server):
        reader, writer = await asyncio.open_connection(server.host, server.port)
        try:
            writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: r\r\ncontent-")
            raw = await closed_by_server(reader)
        finally:
            writer.close()
        assert raw.startswith(b"HTTP/1.1 408 ")
        assert b"proxy.client_header_timeout_s" in raw
        assert refused(gateway, "header_timeout") == 1


async def test_a_body_that_stops_is_408_and_closed() -> None:
    body = chat_body()
    async with router(client_body_timeout_s=0.3) as (gateway, server):
        reader, writer = await asyncio.open_connection(server.host, server.port)
        try:
            writer.write(head("/v1/chat/completions", len(body)) + body[:10])
            raw = await closed_by_server(reader)
        finally:
            writer.close()
        assert raw.startswith(b"HTTP/1.1 408 ")
        status_body = json.loads(raw.partition(b"\r\n\r\n")[2])
        assert status_body["error"]["code"] == "body_timeout"
        assert "proxy.client_body_timeout_s" in status_body["error"]["message"]
        assert refused(gateway, "body_timeout") == 1
        assert forwarded(gateway) == 0


async def test_a_body_that_trickles_is_408_however_steadily_it_trickles() -> None:
    body = chat_body()
    async with router(client_body_timeout_s=0.5) as (gateway, server):
        reader, writer = await asyncio.open_connection(server.host, server.port)
        try:
            writer.write(head("/v1/chat/completions", len(body)))
            raw = b""
            for byte in body:  # one byte every 0.1 s: never idle for long, never done
                if reader.at_eof():
                    break
                try:
                    writer.write(bytes([byte]))
                    await writer.drain()
                except ConnectionError:
                    break
                with contextlib.suppress(TimeoutError):
                    raw += await asyncio.wait_for(reader.read(65536), 0.1)
                if raw:
                    break
            raw += await closed_by_server(reader)
        finally:
            writer.close()
        assert raw.startswith(b"HTTP/1.1 408 ")
        assert refused(gateway, "body_timeout") == 1


async def test_a_complete_slow_request_is_served() -> None:
    body = chat_body()
    async with router(client_body_timeout_s=5.0) as (_, server):
        reader, writer = await asyncio.open_connection(server.host, server.port)
        try:
            writer.write(head("/v1/chat/completions", len(body)) + body[:10])
            await writer.drain()
            await asyncio.sleep(0.2)
            writer.write(body[10:])
            raw = await asyncio.wait_for(read_response(reader), GUARD_S)
        finally:
            writer.close()
        assert raw.startswith(b"HTTP/1.1 200 ")


# -- the log -------------------------------------------------------------------------------


async def test_a_flood_of_refused_requests_logs_one_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    body = chat_body()
    many = [f"x-h{i}: {i}" for i in range(101)]
    data = head("/v1/chat/completions", len(body), *many) + body
    caplog.set_level(logging.WARNING, logger="router.proxy.protocol")
    async with router() as (gateway, server):
        for _ in range(200):
            status, _, _ = await exchange(server, data)
            assert status == 431
        assert refused(gateway, "too_many_headers") == 200
    lines = [r for r in caplog.records if "client request refused" in r.getMessage()]
    assert len(lines) == 1
    assert "more than 100 request headers" in lines[0].getMessage()


async def test_the_router_still_answers_a_plain_client() -> None:
    async with router() as (_, server), httpx.AsyncClient(base_url=server.url) as client:
        r = await client.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 200
