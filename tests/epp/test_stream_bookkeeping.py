"""The stream's bookkeeping (the picked pod's load, the policy's ``on_routed``, the
request's completion) runs once the answers it follows are sent: it never delays an
answer, and when it fails the request goes on (logged and counted), as Envoy's side of
a real gRPC stream sees it."""

from __future__ import annotations

from typing import Any

import pytest

from router.epp import protocol as P
from router.epp.accounting import Accounting
from tests.epp import client as C
from tests.epp.fleet import endpoint, running_epp, settings_for, sim_pods
from tests.epp.test_stream import chat_body, metric, pick
from tests.support.aio import wait_until

pytestmark = pytest.mark.usefixtures("grpc_server")


async def test_a_failing_bookkeeping_step_loses_the_accounting_not_the_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def broken(self: Accounting, pod: str) -> None:
        raise RuntimeError("load store unreachable")

    monkeypatch.setattr(Accounting, "begin", broken)
    async with sim_pods(2) as pods, running_epp(settings_for(pods)) as (server, ch):
        # (one token: a JSON answer that goes as it came, router/proxy/assemble.py)
        stream = await pick(ch, chat_body("hello", max_tokens=1))
        answer, echoed = await stream.read_request_pick()
        # the pick and the body were sent before the step that failed
        assert C.set_headers(answer)[P.DESTINATION_KEY] in {endpoint(p) for p in pods}
        assert echoed == chat_body("hello", max_tokens=1)
        await wait_until(
            lambda: metric(server, "kvroute_epp_streams_total", outcome="bookkeeping_error") == 1,
            "the failure counted",
        )
        # the stream goes on: the answer passes through
        await stream.send(C.response_headers())
        await stream.read(1)
        await stream.send(C.response_body(b'{"choices": []}', True))
        (last,) = await stream.read(1)
        await stream.close()
    assert last.response_body.response.body_mutation.streamed_response.end_of_stream
    # nothing was held for the request, so nothing stays held
    final = server.picker.load.snapshot_now([p.name for p in pods])  # type: ignore[attr-defined]
    assert all(n == 0 for n, _ in final.values())


async def test_the_load_is_taken_before_the_next_message_and_released_after_the_answer() -> None:
    async with sim_pods(1) as pods, running_epp(settings_for(pods)) as (server, ch):
        name = pods[0].name
        load = server.picker.load
        stream = await pick(ch, chat_body("hello"))
        await stream.read_request_pick()
        await stream.send(C.response_headers())
        await stream.read(1)
        assert load.snapshot_now([name])[name][0] == 1  # type: ignore[attr-defined]
        await stream.send(C.response_body(b'{"choices": []}', True))
        await stream.read(1)
        await wait_until(
            lambda: load.snapshot_now([name])[name][0] == 0,  # type: ignore[attr-defined]
            "the load released once the answer was sent",
        )
        await stream.close()
    assert metric(server, "kvroute_requests_total", pod=name, status="200") == 1


@pytest.mark.parametrize(("policy", "reads"), [("cost", False), ("measured", True)])
async def test_the_policy_hears_the_answers_output_tokens_only_if_it_reads_them(
    policy: str, reads: bool
) -> None:
    heard: list[int | None] = []
    async with (
        sim_pods(1) as pods,
        running_epp(settings_for(pods, policy=policy)) as (server, ch),
    ):
        picker = server.picker
        assert picker.policy_reads_output is reads

        def on_finished(request: Any, pod: str, output_tokens: int | None) -> None:
            heard.append(output_tokens)

        # (an instance attribute: the class's, which the flag was read from, is unchanged)
        picker.policy.on_finished = on_finished  # type: ignore[method-assign]
        stream = await pick(ch, chat_body("hello", max_tokens=1))
        await stream.read_request_pick()
        await stream.send(C.response_headers())
        await stream.read(1)
        usage = b'"usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}'
        await stream.send(C.response_body(b'{"choices": [], ' + usage + b"}", True))
        await stream.read(1)
        await stream.close()
        name = pods[0].name
        await wait_until(
            lambda: metric(server, "kvroute_requests_total", pod=name, status="200") == 1,
            "the request completed",
        )
    assert heard == ([7] if reads else [])
