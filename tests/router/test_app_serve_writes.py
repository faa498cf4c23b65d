"""How `kvroute serve` writes responses: everything a response writes within one event-
loop step leaves in one send (uvicorn writes the head and the body separately); and how
it keeps connections alive (idle ones close after ``timeout_keep_alive``, busy ones
stay)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest

from router.proxy.protocol import OneWriteHttpToolsProtocol
from router.proxy.protocol import OneWriteTransport as _OneWriteTransport
from router.proxy.serve import RunningServer


class RecordingTransport(asyncio.Transport):
    """A transport that records what reaches the socket."""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[bytes] = []
        self.closed = False

    def write(self, data: Any) -> None:
        self.sent.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_write_buffer_size(self) -> int:
        return 0


async def test_writes_within_one_loop_step_leave_as_one_send_at_the_end_of_the_step() -> None:
    raw = RecordingTransport()
    t = _OneWriteTransport(raw, asyncio.get_running_loop())
    t.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n")
    t.write(b"ok")
    assert raw.sent == []  # nothing sent yet: still in the same step
    assert t.get_write_buffer_size() == 40
    await asyncio.sleep(0)
    assert raw.sent == [b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"]


async def test_close_sends_what_is_buffered_first() -> None:
    raw = RecordingTransport()
    t = _OneWriteTransport(raw, asyncio.get_running_loop())
    t.write(b"bye")
    t.close()
    assert raw.sent == [b"bye"] and raw.closed


async def test_nothing_is_written_to_a_transport_that_is_already_closing() -> None:
    raw = RecordingTransport()
    t = _OneWriteTransport(raw, asyncio.get_running_loop())
    t.write(b"late")
    raw.closed = True
    await asyncio.sleep(0)
    assert raw.sent == []


async def test_other_transport_calls_reach_the_wrapped_transport() -> None:
    raw = RecordingTransport()
    raw._extra = {"peername": ("127.0.0.1", 1)}  # type: ignore[attr-defined]
    t = _OneWriteTransport(raw, asyncio.get_running_loop())
    assert t.get_extra_info("peername") == ("127.0.0.1", 1)


async def test_served_responses_through_the_one_write_protocol_are_complete() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"x-n", b"1")]})
        await send({"type": "http.response.body", "body": b"part1-", "more_body": True})
        await send({"type": "http.response.body", "body": b"part2"})

    async with RunningServer(app) as server:
        assert server.server.config.http is OneWriteHttpToolsProtocol
        async with httpx.AsyncClient(base_url=server.url) as client:
            for _ in range(3):  # keep-alive: the same connection answers again
                r = await client.get("/")
                assert r.status_code == 200
                assert r.text == "part1-part2" and r.headers["x-n"] == "1"


async def _ok_app(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
    )
    await send({"type": "http.response.body", "body": b"ok"})


async def _call(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert await reader.readexactly(2) == b"ok"


async def test_an_idle_keep_alive_connection_is_closed_after_the_timeout() -> None:
    async with RunningServer(_ok_app, timeout_keep_alive=0.2) as server:
        reader, writer = await asyncio.open_connection(server.host, server.port)
        try:
            await _call(reader, writer)
            # the server closes it (the guard only bounds a hang)
            assert await asyncio.wait_for(reader.read(), 30) == b""
        finally:
            writer.close()


async def test_a_connection_busier_than_the_keep_alive_timeout_stays_open() -> None:
    async with RunningServer(_ok_app, timeout_keep_alive=1.0) as server:
        reader, writer = await asyncio.open_connection(server.host, server.port)
        try:
            # requests 50 ms apart for 2.5 timeouts: the timer fires while the
            # connection is in use and must re-arm, not close it
            loop = asyncio.get_running_loop()
            end = loop.time() + 2.5
            n = 0
            while loop.time() < end:
                await _call(reader, writer)
                n += 1
                await asyncio.sleep(0.05)
            assert n > 10 and not reader.at_eof()
        finally:
            writer.close()


async def test_an_invalid_response_header_is_refused_every_time() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        value = b"bad\nvalue" if scope["path"] == "/bad" else b"fine"
        headers = [(b"x-v", value), (b"content-length", b"2")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": b"ok"})

    async with RunningServer(app) as server, httpx.AsyncClient(base_url=server.url) as client:
        for _ in range(2):
            r = await client.get("/good")
            assert r.status_code == 200 and r.headers["x-v"] == "fine"
        for _ in range(2):  # an invalid value is refused each time: uvicorn drops the
            with pytest.raises(httpx.RemoteProtocolError):  # connection, no response
                await client.get("/bad")
