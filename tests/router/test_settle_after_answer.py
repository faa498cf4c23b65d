"""A complete (JSON) answer goes to the client before the router's bookkeeping of it:
the pod's load, the policy's ``on_finished`` / ``on_complete``, the usage and request
metrics (router/proxy/bookkeeping.py, ``_settle``).  That bookkeeping does not await
and runs right after the answer's one-go write, so it still comes before any other
request is decided.  Real simulated pods and real HTTP on loopback; the one-go write
(router/proxy/oneshot.py) is observed where the response calls it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import pytest

from router.fleet.load import MemoryLoadStore
from router.proxy import relay
from tests.router.app_rig import MODEL, Rig, chat, running, sim
from tests.router.test_json_answers import metric


def _record(rig: Rig, log: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Write to ``log``, in order: the policy's on_routed / on_complete and each answer
    written in one go."""
    policy = rig.gateway.policy
    routed, complete = policy.on_routed, policy.on_complete
    whole: Callable[..., bool] = relay.send_whole

    def on_routed(request: Any, pod: str) -> None:
        log.append("on_routed")
        routed(request, pod)

    def on_complete(request: Any, pod: str) -> None:
        log.append("on_complete")
        complete(request, pod)

    def send_whole(*args: Any) -> bool:
        written = whole(*args)
        if written:
            log.append("written")
        return written

    policy.on_routed = on_routed  # type: ignore[method-assign]
    policy.on_complete = on_complete  # type: ignore[method-assign]
    monkeypatch.setattr(relay, "send_whole", send_whole)


def _open_load(rig: Rig) -> int:
    """Requests the router's load still counts in flight, over its pods."""
    load = rig.gateway.proxy.load
    assert isinstance(load, MemoryLoadStore)  # one replica: no Redis
    names = [p.spec.name for p in rig.gateway.registry.all()]
    return sum(n for n, _ in load.snapshot_now(names).values())


@pytest.mark.parametrize("stream_json", [True, False], ids=["assembled", "as_it_came"])
async def test_a_json_answer_is_written_before_its_bookkeeping_runs(
    stream_json: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with running([sim(0)], policy="cost", proxy={"stream_json_answers": stream_json}) as rig:
        log: list[str] = []
        _record(rig, log, monkeypatch)
        r = await rig.client.post("/v1/chat/completions", json=chat("a story", max_tokens=8))

        assert r.status_code == 200
        assert r.json()["usage"]["completion_tokens"] == 8
        assert log == ["on_routed", "written", "on_complete"]
        assert _open_load(rig) == 0


async def test_with_an_access_log_the_answer_goes_as_messages_and_its_bookkeeping_first(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the access log wraps the ASGI send, whose messages may wait for a slow client:
    # the bookkeeping does not wait with them
    async with running([sim(0)], policy="cost", proxy={"access_log": "on"}) as rig:
        log: list[str] = []
        _record(rig, log, monkeypatch)
        r = await rig.client.post("/v1/chat/completions", json=chat("a story", max_tokens=8))

        assert r.status_code == 200
        assert r.json()["usage"]["completion_tokens"] == 8
        assert log == ["on_routed", "on_complete"]
        assert _open_load(rig) == 0


async def test_a_streamed_answer_keeps_its_bookkeeping_at_the_end_of_the_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with running([sim(0)], policy="cost") as rig:
        log: list[str] = []
        _record(rig, log, monkeypatch)
        body = chat("a story", max_tokens=8, stream=True)
        async with rig.client.stream("POST", "/v1/chat/completions", json=body) as r:
            text = (await r.aread()).decode()

        assert r.status_code == 200 and text.rstrip().endswith("data: [DONE]")
        assert log == ["on_routed", "on_complete"]
        assert _open_load(rig) == 0


async def test_every_answer_is_settled_before_the_next_request_is_decided() -> None:
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
