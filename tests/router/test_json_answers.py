"""A client that asks for a JSON answer (``"stream": false``) through `kvroute serve`: the
router asks the pod for a stream and assembles the JSON answer itself
(``proxy.stream_json_answers``, router/proxy/assemble.py), so it sees the answer's first
token as it sees a stream's.  Real simulated pods and real HTTP on loopback; pods that
misbehave are raw sockets."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.router.app_rig import MODEL, Rig, chat, running, sim
from tests.support.aio import wait_until
from tests.support.one_pod import one_pod_router

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def completion(prompt: str = "hello", **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, **kw}


def metric(text: str, name: str, **labels: str) -> float:
    """The sample ``name{labels}`` of a /metrics text (0 when absent)."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0


class Heard:
    """The first tokens and output tokens the router's (real) policy is told of."""

    def __init__(self, rig: Rig) -> None:
        policy = rig.gateway.policy
        self.first_tokens: list[float] = []
        self.output_tokens: list[int | None] = []
        first, finished = policy.on_first_token, policy.on_finished

        def on_first_token(request: Any, pod: str, ttft_s: float) -> None:
            self.first_tokens.append(ttft_s)
            first(request, pod, ttft_s)

        def on_finished(request: Any, pod: str, output_tokens: int | None) -> None:
            self.output_tokens.append(output_tokens)
            finished(request, pod, output_tokens)

        policy.on_first_token = on_first_token  # type: ignore[method-assign]
        policy.on_finished = on_finished  # type: ignore[method-assign]


@pytest.mark.parametrize(
    ("path", "body", "text_of"),
    [
        ("/v1/chat/completions", chat("tell me", max_tokens=6), lambda c: c["message"]["content"]),
        ("/v1/completions", completion("tell me", max_tokens=6), lambda c: c["text"]),
    ],
    ids=["chat", "completion"],
)
async def test_the_assembled_answer_is_the_pod_s_own_json_answer(
    path: str, body: dict[str, Any], text_of: Callable[[dict[str, Any]], str]
) -> None:
    async with running([sim(0)]) as rig:
        through = await rig.client.post(path, json=body)
        async with httpx.AsyncClient() as direct:
            own = (await direct.post(rig.pods[0].url + path, json=body)).json()
    assert through.status_code == 200, through.text
    assert through.headers["content-type"] == "application/json"
    assert through.headers["x-kvroute-pod"] == "sim-0"
    answer = through.json()
    assert answer["object"] == own["object"]
    assert (answer["model"], answer["system_fingerprint"]) == (
        own["model"],
        own["system_fingerprint"],
    )
    (choice,), (own_choice,) = answer["choices"], own["choices"]
    assert text_of(choice) == text_of(own_choice)
    assert choice["finish_reason"] == own_choice["finish_reason"]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert answer["usage"][key] == own["usage"][key]


@pytest.mark.parametrize(
    ("assemble", "max_tokens", "sees"),
    [(True, 5, True), (False, 5, False), (True, 1, True), (False, 1, True)],
    ids=["assembled", "as it came", "one token", "one token, switch off"],
)
async def test_the_router_sees_a_json_answer_s_first_token_when_it_assembles_it_or_it_is_one(
    assemble: bool, max_tokens: int, sees: bool
) -> None:
    # (measured reads the output tokens: the router calls no policy's on_finished but one
    # of its own, not the base class's no-op)
    proxy = {"stream_json_answers": assemble}
    async with running([sim(0)], proxy=proxy, policy="measured") as rig:
        heard = Heard(rig)
        r = await rig.client.post("/v1/chat/completions", json=chat("hi", max_tokens=max_tokens))
        assert r.status_code == 200, r.text
        text = await rig.metrics()
    ttft_count = metric(text, "kvroute_ttft_seconds_count", pod="sim-0")
    assert (ttft_count, len(heard.first_tokens)) == ((1.0, 1) if sees else (0.0, 0))
    assert heard.output_tokens == [max_tokens]  # the usage is read either way


async def test_a_json_answer_s_prefill_load_ends_at_its_first_token_not_at_its_end() -> None:
    # 40 output tokens at 20 tokens/s: two seconds of decode after the first token
    async with running([sim(0, time_scale=1.0, decode_rate=20.0)]) as rig:
        load = rig.gateway.proxy.load
        request = asyncio.create_task(
            rig.client.post("/v1/chat/completions", json=chat("a few words", max_tokens=40))
        )
        seen: list[tuple[int, int]] = []

        def decoding() -> bool:
            seen.append(load.snapshot_now(["sim-0"])["sim-0"])  # type: ignore[attr-defined]
            return seen[-1] == (1, 0)  # in flight, no prefill left

        await wait_until(decoding, "the request decoding with its prefill load done")
        r = await request
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 40


async def test_a_json_answer_forwarded_as_it_came_leaves_the_queue_when_its_pod_counts_it() -> None:
    # the switch off: the router sees no first token, and 40 output tokens at 10 tokens/s
    # keep the answer decoding for 4 s; the pod's vllm:time_to_first_token_seconds_count,
    # scraped every 0.1 s, shows the request past its prefill long before that
    async with running(
        [sim(0, time_scale=1.0, decode_rate=10.0)],
        proxy={"stream_json_answers": False},
        scrape={"interval_s": 0.1},
    ) as rig:
        load = rig.gateway.proxy.load
        # (the count's baseline: a router scrapes a pod as it registers it)
        await wait_until(lambda: rig.gateway.scraper.get("sim-0") is not None, "a scrape")
        request = asyncio.create_task(
            rig.client.post("/v1/chat/completions", json=chat("a few words", max_tokens=40))
        )
        await wait_until(
            lambda: load.snapshot_now(["sim-0"])["sim-0"] == (1, 0),  # type: ignore[attr-defined]
            "the request decoding with its prefill load released",
            timeout=3.0,
        )
        assert not request.done()
        text = await rig.metrics()
        r = await request
        policy = rig.gateway.policy
        # the pod's decode-time histogram teaches the decode time no first token could
        await wait_until(
            lambda: policy.learned().get(("decode_seconds", MODEL), 0.0) > 3.0,
            "the decode time learned from the pod's histogram",
        )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 40
    assert metric(text, "kvroute_unseen_first_tokens_total") == 1
    assert metric(text, "kvroute_ttft_seconds_count", pod="sim-0") == 0


async def test_a_client_that_leaves_mid_answer_cancels_the_assembly_and_the_pod_s_request() -> None:
    # 100 output tokens at 10 tokens/s: ten seconds of decode, cut after the first token
    async with running([sim(0, time_scale=1.0, decode_rate=10.0)]) as rig:
        load = rig.gateway.proxy.load
        leaving = httpx.AsyncClient(base_url=rig.router.url, timeout=30)
        request = asyncio.create_task(
            leaving.post("/v1/chat/completions", json=chat("a few words", max_tokens=100))
        )
        await wait_until(
            lambda: load.snapshot_now(["sim-0"])["sim-0"] == (1, 0),  # type: ignore[attr-defined]
            "the request decoding",
        )
        request.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await request
        await leaving.aclose()
        await wait_until(
            lambda: load.snapshot_now(["sim-0"])["sim-0"] == (0, 0),  # type: ignore[attr-defined]
            "the request's load released long before its answer would end",
            timeout=5.0,
        )
        text = await rig.metrics()

        async def pod_running() -> float:
            pod_text = (await rig.client.get(rig.pods[0].url + "/metrics")).text
            assert "vllm:num_requests_running" in pod_text
            return metric(pod_text, "vllm:num_requests_running")

        running_then = [await pod_running()]
        for _ in range(100):  # the pod aborts the request once its connection closed
            if running_then[-1] == 0:
                break
            await asyncio.sleep(0.05)
            running_then.append(await pod_running())
    assert metric(text, "kvroute_requests_total", pod="sim-0", status="499") == 1
    assert running_then[-1] == 0


@contextlib.asynccontextmanager
async def raw_pod(handler: Handler) -> AsyncIterator[str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(server.wait_closed(), 2)


async def _read_request(reader: asyncio.StreamReader) -> None:
    head = await reader.readuntil(b"\r\n\r\n")
    lengths = [
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    ]
    await reader.readexactly(sum(lengths))


def sse_pod(events: list[bytes], then: str) -> Handler:
    """A pod that answers 200 text/event-stream with ``events`` (chunked), then either
    ends the answer (``end``) or closes the connection mid-answer (``close``)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
        )
        for e in events:
            writer.write(b"%x\r\n%s\r\n" % (len(e), e))
        if then == "end":
            writer.write(b"0\r\n\r\n")
        await writer.drain()
        writer.close()

    return handle


@contextlib.asynccontextmanager
async def beside_a_sim_pod(handler: Handler) -> AsyncIterator[Rig]:
    """A router over ``sim-0`` and a raw pod ``hung`` served by ``handler``, round robin
    (the first request goes to one, the next to the other), a first-byte deadline of
    0.3 s and one failover."""
    async with (
        raw_pod(handler) as hung,
        running(
            [sim(0)],
            proxy={"first_byte_timeout_s": 0.3, "retries": 1},
            health={"enabled": False},
            other_pods=({"name": "hung", "url": hung, "models": [MODEL]},),
            policy="round_robin",
        ) as rig,
    ):
        yield rig


def hangs(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Awaitable[None]:
    """A pod that takes the request and never answers (a hung engine)."""

    async def handle() -> None:
        await _read_request(reader)
        await asyncio.sleep(30)
        writer.close()

    return handle()


def first_chunk() -> bytes:
    chunk = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": MODEL}
    delta = {"index": 0, "delta": {"role": "assistant", "content": "x"}, "finish_reason": None}
    return b"data: " + json.dumps({**chunk, "choices": [delta]}).encode() + b"\n\n"


ERROR_EVENT = b'data: {"error": {"message": "engine died"}}\n\n'


@pytest.mark.parametrize(
    ("events", "then", "code"),
    [
        ([first_chunk()], "close", "transport"),
        (
            [first_chunk(), b'data: {"error": {"message": "engine died"}}\n\n'],
            "end",
            "stream_error",
        ),
        ([b"data: not json\n\n"], "end", "stream_unreadable"),
    ],
    ids=["broken mid-answer", "error event", "not a completion"],
)
async def test_a_stream_that_gives_no_whole_answer_is_a_502_error_never_half_an_answer(
    events: list[bytes], then: str, code: str
) -> None:
    async with (
        raw_pod(sse_pod(events, then)) as url,
        one_pod_router("bad", url, MODEL, proxy={"retries": 0}) as (_, client),
    ):
        r = await client.post("/v1/chat/completions", json=chat("hi"))
        text = (await client.get("/metrics")).text
    assert r.status_code == 502, r.text
    error = r.json()["error"]
    assert error["code"] == code
    assert metric(text, "kvroute_upstream_errors_total", pod="bad", reason=code) == 1
    assert metric(text, "kvroute_requests_total", pod="bad", status="502") == 1


@pytest.mark.parametrize("max_tokens", [None, 1], ids=["assembled", "one token"])
async def test_a_pod_hung_before_a_json_answer_s_first_token_is_failed_over(
    max_tokens: int | None,
) -> None:
    """The first-byte deadline, once a stream's only, now covers JSON answers too: those
    assembled from a stream, and those of one token (their head is their token)."""
    limit = {} if max_tokens is None else {"max_tokens": max_tokens}
    async with beside_a_sim_pod(hangs) as rig:
        answers = [
            await rig.client.post("/v1/chat/completions", json=chat(f"q{i}", **limit))
            for i in range(2)
        ]
        text = await rig.metrics()
    assert [(a.status_code, a.headers["x-kvroute-pod"]) for a in answers] == [(200, "sim-0")] * 2
    assert metric(text, "kvroute_retries_total", reason="first_byte_timeout") == 1
