"""A complete (JSON) answer goes to the client before the router's bookkeeping of it:
the pod's load, the policy's ``on_finished`` / ``on_complete``, the usage and request
metrics (router/proxy/bookkeeping.py, ``_settle``).  That bookkeeping does not await,
so it still runs before any other request is decided.  Real simulated pods and real
HTTP on loopback; the app is also called as ASGI to see the order of its messages."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest

from router.fleet.load import MemoryLoadStore
from tests.router.app_rig import MODEL, Rig, chat, running, sim
from tests.router.test_json_answers import metric


def _scope(body: bytes) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/chat/completions",
        "raw_path": b"/v1/chat/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"127.0.0.1"),
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(body)),
        ],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8000),
        "state": {},
    }


async def _asgi_call(rig: Rig, body: dict[str, Any], log: list[str]) -> bytes:
    """One request straight into the running router's ASGI app; its messages and the
    policy's hooks are written to ``log`` in the order they happen."""
    raw = json.dumps(body).encode()
    delivered = False
    out = bytearray()

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await asyncio.Event().wait()  # the client never goes away
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        log.append(message["type"])
        out.extend(message.get("body", b""))

    app: Any = rig.router.server.config.app
    await app(_scope(raw), receive, send)
    return bytes(out)


def _record_hooks(rig: Rig, log: list[str]) -> None:
    policy = rig.gateway.policy
    routed, complete = policy.on_routed, policy.on_complete

    def on_routed(request: Any, pod: str) -> None:
        log.append("on_routed")
        routed(request, pod)

    def on_complete(request: Any, pod: str) -> None:
        log.append("on_complete")
        complete(request, pod)

    policy.on_routed = on_routed  # type: ignore[method-assign]
    policy.on_complete = on_complete  # type: ignore[method-assign]


def _open_load(rig: Rig) -> int:
    """Requests the router's load still counts in flight, over its pods."""
    load = rig.gateway.proxy.load
    assert isinstance(load, MemoryLoadStore)  # one replica: no Redis
    names = [p.spec.name for p in rig.gateway.registry.all()]
    return sum(n for n, _ in load.snapshot_now(names).values())


@pytest.mark.parametrize("stream_json", [True, False], ids=["assembled", "as_it_came"])
async def test_a_json_answer_is_written_before_its_bookkeeping_runs(stream_json: bool) -> None:
    async with running([sim(0)], policy="cost", proxy={"stream_json_answers": stream_json}) as rig:
        log: list[str] = []
        _record_hooks(rig, log)
        body = await _asgi_call(rig, chat("tell me a story", max_tokens=8), log)

        answer = json.loads(body)
        assert answer["object"] == "chat.completion"
        assert log == ["on_routed", "http.response.start", "http.response.body", "on_complete"]
        assert _open_load(rig) == 0  # settled by the time the app returned


async def test_a_streamed_answer_keeps_its_bookkeeping_at_the_end_of_the_stream() -> None:
    async with running([sim(0)], policy="cost") as rig:
        log: list[str] = []
        _record_hooks(rig, log)
        await _asgi_call(rig, chat("tell me a story", max_tokens=8, stream=True), log)

        assert log[0] == "on_routed"
        assert log[-1] == "on_complete"
        assert log.count("on_complete") == 1
        assert _open_load(rig) == 0


async def test_over_http_every_answer_is_settled_before_the_next_request_is_decided() -> None:
    async with running([sim(0), sim(1)], policy="cost") as rig:
        policy = rig.gateway.policy
        open_at_routing: list[int] = []
        routed = policy.on_routed

        def on_routed(request: Any, pod: str) -> None:
            open_at_routing.append(_open_load(rig))
            routed(request, pod)

        policy.on_routed = on_routed  # type: ignore[method-assign]
        for i in range(6):  # one after the other, on one keep-alive connection
            r = await rig.client.post("/v1/chat/completions", json=chat(f"q{i}", max_tokens=4))
            assert r.status_code == 200
            assert r.json()["usage"]["completion_tokens"] == 4

        assert open_at_routing == [0] * 6
        text = await rig.metrics()
        served = sum(
            metric(text, "kvroute_requests_total", model=MODEL, pod=p, status="200")
            for p in ("sim-0", "sim-1")
        )
        assert served == 6


async def test_a_bug_in_the_bookkeeping_is_logged_and_the_answer_and_the_load_survive(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with running([sim(0)], policy="cost") as rig:
        policy = rig.gateway.policy
        complete = policy.on_complete
        calls: list[str] = []

        def broken(request: Any, pod: str) -> None:
            calls.append(pod)
            complete(request, pod)
            raise RuntimeError("a bug in a hook")

        policy.on_complete = broken  # type: ignore[method-assign]
        with caplog.at_level(logging.ERROR):
            first = await rig.client.post("/v1/chat/completions", json=chat("a", max_tokens=4))
            second = await rig.client.post("/v1/chat/completions", json=chat("b", max_tokens=4))

        assert first.status_code == second.status_code == 200
        assert first.json()["usage"]["completion_tokens"] == 4
        assert calls == ["sim-0", "sim-0"]
        assert _open_load(rig) == 0  # the load ended before the hook raised
        failed = [r for r in caplog.records if "bookkeeping of an answer" in r.getMessage()]
        assert len(failed) == 1  # once per cause and interval, with its traceback
        assert failed[0].exc_info is not None
