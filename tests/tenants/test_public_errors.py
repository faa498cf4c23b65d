"""With tenants, no failure of the fleet shows a tenant where the fleet is: every kind
of upstream failure answers an OpenAI error whose body and headers name no pod address
or URL (no ``x-kvroute-pod`` on an error; the detail goes to the log).  Without
tenants the operator's own errors keep naming the pod (a single-operator deployment
debugs with them).

The pods here are real sockets on 127.0.0.1 that fail in one way each: a closed port
(connect refused), a server that answers 500 with its own address in the body, one
that accepts and never answers (first-byte deadline for a stream and for a JSON answer
the router assembles from one, read timeout for a JSON answer sent as it came), one
that closes the connection without a response, one whose stream ends in an error event
or is not a completion's (a JSON answer the router assembles gets none), and a pod
ejected by health checks (no healthy pod).  The pods are named by their address, as DNS discovery
names them, so that a pod name in a message would be an address too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from router.config import Settings
from tests.support.aio import wait_until
from tests.tenants.rig import KEY_A, MODEL, auth, router, two_tenants

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    """One request read whole; its head."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    await reader.readexactly(length)
    return head


def answers(head: bytes, body: Callable[[str], bytes]) -> Callable[[str], Handler]:
    """A pod that answers every request with ``head`` (status line and headers) and
    ``body(its URL)``."""

    def make(url: str) -> Handler:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                await _read_request(reader)
                data = body(url)
                writer.write(head + b"content-length: %d\r\n\r\n%s" % (len(data), data))
                await writer.drain()
            writer.close()

        return handle

    return make


#: a pod that answers 500 with its own address in the body
answers_500 = answers(
    b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\n",
    lambda url: json.dumps({"error": {"message": f"engine at {url} crashed"}}).encode(),
)


def streams(event: bytes) -> Callable[[str], Handler]:
    """A pod that answers 200 with an event stream of one ``event`` (``{url}`` in it
    replaced by its address): a JSON answer the router assembles gets no whole answer."""
    return answers(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n",
        lambda url: event.replace(b"{url}", url.encode()),
    )


def never_answers(url: str) -> Handler:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            await _read_request(reader)
            await asyncio.sleep(30)
        writer.close()

    return handle


def hangs_up(url: str) -> Handler:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            await _read_request(reader)
        writer.close()

    return handle


@contextlib.asynccontextmanager
async def failing_pod(make: Callable[[str], Handler] | None) -> AsyncIterator[str]:
    """The URL of a pod on 127.0.0.1 that fails as ``make`` says (None: a closed port)."""
    box: list[str] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await make(box[0])(reader, writer)  # type: ignore[misc]

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    box.append(f"http://127.0.0.1:{port}")
    if make is None:
        server.close()
        await server.wait_closed()
    try:
        yield box[0]
    finally:
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 2)


def settings(url: str, tenants: bool, **overrides: Any) -> Settings:
    name = url.split("//", 1)[1]
    return Settings.model_validate(
        {
            "discovery": {"static": [{"name": name, "url": url, "models": [MODEL]}]},
            "events": {"enabled": False},
            "fleet": {"enabled": False},
            "health": {"enabled": False},
            "proxy": {"retries": 0, "first_byte_timeout_s": 0.5, "read_timeout_s": 0.5},
            **(two_tenants() if tenants else {}),
            **overrides,
        }
    )


def completion(stream: bool | None) -> dict[str, Any]:
    """A stream (True), a JSON answer (False: asked of the pod as a stream and assembled,
    router/proxy/assemble.py), or a JSON answer sent as it came (None: it asks for
    logprobs, which are not assembled)."""
    body = {"model": MODEL, "prompt": [7] * 40, "max_tokens": 4, "stream": bool(stream)}
    return body if stream is not None else {**body, "logprobs": 1}


def leaks(text: str, url: str) -> list[str]:
    host_port = url.split("//", 1)[1]
    return [s for s in ("127.0.0.1:", url, host_port, host_port.rsplit(":", 1)[1]) if s in text]


#: failure kind -> (the pod, the request's kind (``completion``), the status, the error code)
FAILURES: dict[str, tuple[Callable[[str], Handler] | None, bool | None, int, str]] = {
    "connect refused": (None, False, 502, "connect"),
    "connect refused, stream": (None, True, 502, "connect"),
    "5xx before the first byte": (answers_500, False, 500, "status_500"),
    "5xx before the first byte, stream": (answers_500, True, 500, "status_500"),
    "first-byte timeout": (never_answers, True, 504, "first_byte_timeout"),
    "first-byte timeout, JSON answer": (never_answers, False, 504, "first_byte_timeout"),
    "read timeout": (never_answers, None, 504, "upstream_timeout"),
    "connection closed without an answer": (hangs_up, False, 502, "transport"),
    "an error event, JSON answer": (
        streams(b'data: {"error": {"message": "engine at {url} died"}}\n\n'),
        False,
        502,
        "stream_error",
    ),
    "not a completion's stream, JSON answer": (
        streams(b"data: engine at {url} is confused\n\n"),
        False,
        502,
        "stream_unreadable",
    ),
}


@pytest.mark.parametrize("kind", sorted(FAILURES))
async def test_a_tenant_facing_error_names_no_pod_address(kind: str, caplog: Any) -> None:
    make, stream, status, code = FAILURES[kind]
    async with failing_pod(make) as url, router(settings(url, tenants=True)) as client:
        r = await client.post("/v1/completions", json=completion(stream), headers=auth(KEY_A))
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert error["code"] == code
        assert not leaks(r.text, url), r.text
        assert not leaks(str(r.headers), url), r.headers  # no x-kvroute-pod either
    # the operator keeps the detail: the pod is named in the log
    assert any(url.split("//", 1)[1] in rec.getMessage() for rec in caplog.records)


async def test_no_healthy_pod_is_a_503_that_names_no_pod_address() -> None:
    health = {"enabled": True, "interval_s": 0.1, "timeout_s": 0.2, "failure_threshold": 1}
    async with failing_pod(None) as url, router(settings(url, True, health=health)) as client:
        body = completion(False)

        async def ejected() -> bool:
            r = await client.post("/v1/completions", json=body, headers=auth(KEY_A))
            return r.status_code == 503

        await wait_until(ejected, timeout=10)
        r = await client.post("/v1/completions", json=body, headers=auth(KEY_A))
        assert r.json()["error"]["code"] == "no_healthy_pod"
        assert not leaks(r.text, url), r.text
        assert not leaks(str(r.headers), url), r.headers


async def test_without_tenants_the_operators_errors_still_name_the_pod() -> None:
    async with failing_pod(None) as url, router(settings(url, tenants=False)) as client:
        r = await client.post("/v1/completions", json=completion(False))
        assert r.status_code == 502 and url.split("//", 1)[1] in r.json()["error"]["message"]
    async with failing_pod(answers_500) as url, router(settings(url, tenants=False)) as client:
        r = await client.post("/v1/completions", json=completion(False))
        assert r.status_code == 500 and "crashed" in r.text  # the pod's own body, relayed


async def test_a_pods_4xx_body_reaches_the_tenant_as_the_pod_wrote_it() -> None:
    async def bad_request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            await _read_request(reader)
            body = b'{"error":{"message":"max_tokens is too large","code":400}}'
            writer.write(
                b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )
            await writer.drain()
        writer.close()

    async with (
        failing_pod(lambda url: bad_request) as url,
        router(settings(url, tenants=True)) as client,
    ):
        r = await client.post("/v1/completions", json=completion(False), headers=auth(KEY_A))
        assert r.status_code == 400 and "max_tokens is too large" in r.text


def stores_then_fails(url: str) -> Handler:
    """Creates a response (POST /v1/responses), then answers 500 to everything else."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(Exception):
            head = await _read_request(reader)
            if head.startswith(b"POST /v1/responses "):
                status, body = b"200 OK", json.dumps({"id": "resp_kept", "object": "response"})
            else:
                status, body = b"500 Internal Server Error", json.dumps({"error": f"{url} down"})
            writer.write(
                b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (status, len(body), body.encode())
            )
            await writer.drain()
        writer.close()

    return handle


async def test_a_stored_responses_pod_failing_with_5xx_names_no_address() -> None:
    async with failing_pod(stores_then_fails) as url, router(settings(url, True)) as client:
        body = {"model": MODEL, "input": "hello", "max_output_tokens": 4}
        created = await client.post("/v1/responses", json=body, headers=auth(KEY_A))
        assert created.status_code == 200 and created.json()["id"] == "resp_kept"
        r = await client.get("/v1/responses/resp_kept", headers=auth(KEY_A))
        assert r.status_code == 500 and r.json()["error"]["code"] == "status_500"
        assert not leaks(r.text, url) and not leaks(str(r.headers), url), (r.text, r.headers)
