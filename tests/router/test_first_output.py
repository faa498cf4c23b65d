"""A Responses API stream's first token (router/proxy/first_output.py): vLLM opens the
stream with ``response.created`` and ``response.in_progress`` before its engine runs the
request, so the first token is the first event of another type, however the stream is
cut into chunks.  Through `kvroute serve`, a simulated pod with a slow prefill shows
the router timing the prefill, not the opening."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any

import httpx
import pytest

from router.proxy.first_output import FirstOutput
from router.proxy.sse import event_name
from router.sim.wire import sse_event
from tests.router.app_rig import MODEL, running, sim
from tests.router.test_json_answers import Heard, _read_request, beside_a_sim_pod, metric

CREATED = sse_event({"type": "response.created", "response": {"id": "resp_1"}})
IN_PROGRESS = sse_event({"type": "response.in_progress", "response": {"id": "resp_1"}})
DELTA = sse_event({"type": "response.output_text.delta", "delta": "Hi"})


def first_output_chunk(chunks: list[bytes]) -> int | None:
    """The index of the chunk a fresh watch says holds the first output event."""
    watch = FirstOutput()
    return next((i for i, c in enumerate(chunks) if watch.seen_in(c)), None)


def test_the_opening_events_are_not_output_and_the_next_event_is() -> None:
    assert first_output_chunk([CREATED, IN_PROGRESS, DELTA]) == 2
    assert first_output_chunk([CREATED, IN_PROGRESS]) is None
    queued = sse_event({"type": "response.queued"})  # OpenAI's API may open with it
    assert first_output_chunk([queued, CREATED, IN_PROGRESS, DELTA]) == 3
    # any other event is output: vLLM sends every later one after the engine's output
    added = sse_event({"type": "response.output_item.added", "output_index": 0})
    assert first_output_chunk([CREATED, IN_PROGRESS, added, DELTA]) == 2


@pytest.mark.parametrize("size", [1, 3, 17, 10_000])
def test_the_first_output_is_found_however_the_stream_is_cut(size: int) -> None:
    stream = CREATED + IN_PROGRESS + DELTA
    chunks = [stream[i : i + size] for i in range(0, len(stream), size)]
    at = first_output_chunk(chunks)
    assert at is not None
    # the chunk that completes the delta event, not one before it
    assert size * at < len(stream) <= size * (at + 1)


def test_crlf_comments_and_data_only_events_are_read() -> None:
    crlf = [c.replace(b"\n", b"\r\n") for c in (CREATED, IN_PROGRESS, DELTA)]
    assert first_output_chunk(crlf) == 2
    assert first_output_chunk([b": keep-alive\n\n", CREATED, DELTA]) == 2
    data_only = [b'data: {"type": "response.created"}\n\n', b'data: {"type": "x.delta"}\n\n']
    assert first_output_chunk(data_only) == 1


def test_an_event_it_cannot_name_counts_as_output_as_any_stream_s_first_byte() -> None:
    assert first_output_chunk([b"data: not json\n\n"]) == 0
    assert first_output_chunk([b'data: {"no": "type"}\n\n']) == 0
    # an opening event that never ends within the limit: the first byte's rule again
    huge = b"event: response.created\ndata: " + b"x" * (FirstOutput.LIMIT + 1)
    assert first_output_chunk([huge]) == 0


def test_event_name_is_the_event_line_else_the_data_s_type() -> None:
    assert event_name(b'event: a.b\ndata: {"type": "c.d"}') == b"a.b"
    assert event_name(b'data: {"type": "c.d"}') == b"c.d"
    assert event_name(b": a comment") is None
    assert event_name(b"data: [1, 2]") is None


def _responses(text: str, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": text, "stream": True, **kw}


async def test_the_router_times_a_responses_stream_s_prefill_not_its_opening() -> None:
    """The pod opens the stream at once and runs a prefill of ~0.65 s (about 130 prompt
    tokens at 200 tokens/s) before its first output: the router's TTFT is that output's,
    and the opening events went to the client with it (held for the first-byte
    deadline, as a chat stream's head is)."""
    pod = sim(0, time_scale=1.0, prefill_rate=200.0, decode_rate=50.0)
    async with running([pod]) as rig:
        heard = Heard(rig)
        arrived: dict[str, float] = {}
        t0 = time.perf_counter()
        body = _responses("a few words of a long question " * 20, max_output_tokens=4)
        async with rig.client.stream("POST", "/v1/responses", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("event: "):
                    arrived.setdefault(line[7:], time.perf_counter() - t0)
        text = await rig.metrics()
    (ttft,) = heard.first_tokens
    assert 0.3 < ttft <= arrived["response.output_text.delta"]
    assert arrived["response.created"] > 0.3  # held with the request until its output
    assert metric(text, "kvroute_ttft_seconds_count", pod="sim-0") == 1


async def test_a_sim_pod_opens_a_responses_stream_as_vllm_does() -> None:
    """vLLM sends ``response.created`` and ``response.in_progress`` at once, and
    ``response.output_item.added`` with the engine's first output, after the prefill
    (the sim sent it ahead of the prefill before)."""
    pod = sim(0, time_scale=1.0, prefill_rate=200.0, decode_rate=50.0)
    body = _responses("a few words of a long question " * 20, max_output_tokens=2)
    async with running([pod]) as rig, httpx.AsyncClient() as direct:
        t0 = time.perf_counter()
        async with direct.stream("POST", rig.pods[0].url + "/v1/responses", json=body) as r:
            events = [
                (line[7:], time.perf_counter() - t0)
                async for line in r.aiter_lines()
                if line.startswith("event: ")
            ]
    kinds = [kind for kind, _ in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.output_text.delta",
    ]
    assert kinds[-1] == "response.completed"
    at = dict(reversed(events))  # each kind's first arrival
    assert at["response.output_item.added"] - at["response.in_progress"] > 0.3


def opens_then_hangs(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Awaitable[None]:
    """A pod that opens a Responses stream as vLLM does, then never runs the request."""

    async def handle() -> None:
        await _read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        for e in (CREATED, IN_PROGRESS):
            writer.write(b"%x\r\n%s\r\n" % (len(e), e))
        await writer.drain()
        await asyncio.sleep(30)
        writer.close()

    return handle()


async def test_a_pod_that_opens_a_responses_stream_and_hangs_is_failed_over() -> None:
    """The first-byte deadline waits for a Responses stream's first output, holding its
    opening events: a pod stuck before its engine's first output is left for the next
    one, and the client sees only that pod's stream."""
    async with beside_a_sim_pod(opens_then_hangs) as rig:
        streams = []
        for i in range(2):  # round robin: one of them is sent to the hung pod first
            async with rig.client.stream("POST", "/v1/responses", json=_responses(f"q{i}")) as r:
                raw = b"".join([c async for c in r.aiter_raw()])
                streams.append((r.status_code, r.headers["x-kvroute-pod"], raw))
        text = await rig.metrics()
    for status, pod, raw in streams:
        assert (status, pod) == (200, "sim-0")
        assert raw.count(b"event: response.created") == 1
        assert raw.rstrip().endswith(b"}") and b"event: response.completed" in raw
    assert metric(text, "kvroute_retries_total", reason="first_byte_timeout") == 1
