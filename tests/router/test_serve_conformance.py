"""`kvroute serve`'s HTTP protocol (:class:`router.proxy.protocol.OneWriteHttpToolsProtocol`)
answers byte for byte as uvicorn's own ``HttpToolsProtocol`` does: the same ASGI app
behind each, on real loopback sockets, the same raw requests, the same raw bytes back
(the ``date`` header masked).  The proxy's complete answers (``/raw*``:
:class:`router.proxy.relay.RawResponse`) are written in one go on ours
(:mod:`router.proxy.oneshot`) and as ASGI messages on uvicorn's."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from router.proxy.protocol import OneWriteHttpToolsProtocol
from router.proxy.relay import RawResponse
from router.proxy.serve import RunningServer


async def app(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    path = scope["path"]

    async def start(status: int, headers: list[tuple[bytes, bytes]]) -> None:
        await send({"type": "http.response.start", "status": status, "headers": headers})

    if path == "/length":
        await start(200, [(b"content-type", b"application/json"), (b"content-length", b"11")])
        await send({"type": "http.response.body", "body": b'{"ok":true}'})
    elif path == "/stream":  # no content-length: chunked
        await start(200, [(b"content-type", b"text/event-stream")])
        for part in (b"data: 1\n\n", b"data: 2\n\n"):
            await send({"type": "http.response.body", "body": part, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    elif path == "/explicit-chunked":
        await start(200, [(b"transfer-encoding", b"chunked")])
        await send({"type": "http.response.body", "body": b"abc", "more_body": True})
        await send({"type": "http.response.body", "body": b""})
    elif path in ("/204", "/304"):
        await start(int(path[1:]), [(b"x-n", b"1")])
        await send({"type": "http.response.body", "body": b""})
    elif path == "/close":  # the app asks to close the connection
        await start(200, [(b"connection", b"close"), (b"content-length", b"2")])
        await send({"type": "http.response.body", "body": b"ok"})
    elif path == "/bad-value":  # refused by the server: no response, connection dropped
        await start(200, [(b"x-v", b"bad\nvalue"), (b"content-length", b"2")])
        await send({"type": "http.response.body", "body": b"ok"})
    elif path == "/bad-name":
        await start(200, [(b"x v", b"1"), (b"content-length", b"2")])
        await send({"type": "http.response.body", "body": b"ok"})
    elif path == "/error":  # the app fails before answering: uvicorn's 500
        raise RuntimeError("boom")
    elif path in RAW:  # the proxy's complete answer
        status, headers = RAW[path]
        await RawResponse(status, headers, b'{"id":"x"}')(scope, receive, send)
    else:
        await start(404, [(b"content-length", b"0")])
        await send({"type": "http.response.body", "body": b""})


#: the proxy's complete answers: (status, headers); the last three take uvicorn's path
RAW: dict[str, tuple[int, list[tuple[bytes, bytes]]]] = {
    "/raw": (200, [(b"content-type", b"application/json"), (b"x-kvroute-pod", b"a")]),
    "/raw-404": (404, [(b"content-type", b"application/json")]),
    "/raw-upper": (200, [(b"Content-Type", b"application/json")]),
    "/raw-close": (200, [(b"connection", b"close")]),
    "/raw-bad-value": (200, [(b"x-v", b"bad\nvalue")]),
}


def req(method: str, path: str, *extra: str, version: str = "1.1", body: bytes = b"") -> bytes:
    lines = [f"{method} {path} HTTP/{version}", "host: x", *extra]
    if body:
        lines.append(f"content-length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


CLOSE = "connection: close"

#: (name, the requests sent one after the other on one connection, each awaited for its
#: answer except where sent together); every scenario ends with the server closing
SCENARIOS: dict[str, list[bytes]] = {
    "content-length": [req("GET", "/length", CLOSE)],
    "post body": [req("POST", "/length", CLOSE, body=b'{"prompt":"hi"}')],
    "streaming (chunked)": [req("GET", "/stream", CLOSE)],
    "explicit chunked": [req("GET", "/explicit-chunked", CLOSE)],
    "HEAD": [req("HEAD", "/length", CLOSE)],
    "HEAD of a stream": [req("HEAD", "/stream", CLOSE)],
    "204": [req("GET", "/204", CLOSE)],
    "304": [req("GET", "/304", CLOSE)],
    "404": [req("GET", "/nope", CLOSE)],
    "app sends connection: close": [req("GET", "/close")],
    "HTTP/1.0 (no keep-alive)": [req("GET", "/length", version="1.0")],
    "keep-alive reuse": [
        req("GET", "/length"),
        req("GET", "/stream"),
        req("GET", "/204"),
        req("POST", "/length", body=b"{}"),
        req("GET", "/length", CLOSE),
    ],
    "pipelined": [req("GET", "/length") + req("GET", "/stream") + req("GET", "/length", CLOSE)],
    "invalid header value refused": [req("GET", "/length"), req("GET", "/bad-value")],
    "invalid header name refused": [req("GET", "/bad-name")],
    "app error -> 500": [req("GET", "/error")],
    "raw answer": [req("POST", "/raw", CLOSE, body=b'{"prompt":"hi"}')],
    "raw answers on one connection": [
        req("POST", "/raw", body=b"{}"),
        req("POST", "/raw-404", body=b"{}"),
        req("GET", "/stream"),
        req("POST", "/raw", CLOSE, body=b"{}"),
    ],
    "raw answers pipelined": [req("POST", "/raw", body=b"{}") + req("POST", "/raw", CLOSE)],
    "raw answer, HTTP/1.0": [req("POST", "/raw", version="1.0", body=b"{}")],
    "raw answer to HEAD": [req("HEAD", "/raw", CLOSE)],
    "raw answer, uppercase header name": [req("POST", "/raw-upper", CLOSE)],
    "raw answer asking to close": [req("POST", "/raw-close")],
    "raw answer, invalid header value refused": [req("POST", "/raw-bad-value")],
    "malformed request -> 400": [b"GARBAGE\r\n\r\n"],
}

#: scenarios whose only request is refused without an answer
NO_ANSWER = {"invalid header name refused", "raw answer, invalid header value refused"}

DATE = re.compile(rb"\r\ndate: [^\r]*\r\n")


async def exchange(server: RunningServer, requests: list[bytes]) -> bytes:
    reader, writer = await asyncio.open_connection(server.host, server.port)
    out = b""
    try:
        for i, data in enumerate(requests):
            writer.write(data)
            if i < len(requests) - 1:  # until this answer is complete (a short quiet spell)
                while True:
                    try:
                        out += await asyncio.wait_for(reader.read(65536), 0.2)
                    except TimeoutError:
                        break
        # the last request: the server closes the connection (the guard bounds a hang)
        while chunk := await asyncio.wait_for(reader.read(65536), 30):
            out += chunk
    finally:
        writer.close()
    return DATE.sub(b"\r\ndate: -\r\n", out)


async def on_both(stock_app: Any, our_app: Any, requests: list[bytes]) -> tuple[bytes, bytes]:
    """The bytes answered to ``requests`` by uvicorn's protocol serving ``stock_app`` and
    by the router's serving ``our_app``."""
    async with (
        RunningServer(stock_app, http=HttpToolsProtocol) as stock,
        RunningServer(our_app, http=OneWriteHttpToolsProtocol) as ours,
    ):
        return await exchange(stock, requests), await exchange(ours, requests)


@pytest.mark.parametrize("name", list(SCENARIOS))
async def test_the_router_protocol_answers_byte_for_byte_like_uvicorns(name: str) -> None:
    expected, got = await on_both(app, app, SCENARIOS[name])
    assert got == expected
    assert expected.startswith(b"HTTP/1.") or name in NO_ANSWER


async def test_an_invalid_header_is_refused_with_no_response_bytes() -> None:
    async with RunningServer(app) as server:
        assert await exchange(server, [req("GET", "/bad-value")]) == b""
