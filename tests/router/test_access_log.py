"""The access log: one line per generation request when its response ends, with the
routing facts an operator needs (pod, tokens, status, TTFT, latency) and never the
prompt; off unless asked for, sampled when asked to."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from router.config import Settings
from router.proxy.access_log import LOGGER, AccessLog, format_line
from tests.router.app_rig import MODEL, running, sim
from tests.router.test_proxy import CHAT, make_rig, ok

__all__ = ["make_rig"]  # the fixture, shared with test_proxy

SECRET = "the-launch-code-is-7431-do-not-log"


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def lines() -> Iterator[list[str]]:
    handler = _Lines()
    logger = logging.getLogger(LOGGER)
    logger.addHandler(handler)
    try:
        yield handler.lines
    finally:
        logger.removeHandler(handler)


def _chat(content: str, **kw: object) -> dict[str, object]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}


async def test_a_json_line_names_the_pod_the_tokens_the_status_and_the_latency(
    lines: list[str],
) -> None:
    proxy = {"access_log": "on", "access_log_format": "json"}
    async with running([sim(0)], proxy=proxy) as rig:
        r = await rig.client.post("/v1/chat/completions", json=_chat(SECRET, max_tokens=4))
        assert r.status_code == 200
    (line,) = lines
    entry = json.loads(line)
    assert entry["method"] == "POST" and entry["path"] == "/v1/chat/completions"
    assert entry["status"] == 200 and entry["model"] == MODEL
    assert entry["pod"] == r.headers["x-kvroute-pod"]
    assert entry["prompt_tokens"] == r.json()["usage"]["prompt_tokens"]
    assert entry["cached_tokens"] == 0  # a first request: nothing cached yet
    assert entry["ttft_ms"] is None  # not a stream
    assert entry["latency_ms"] > 0 and entry["end"] is None
    assert entry["ts"].endswith("Z")


async def test_a_stream_is_logged_at_its_end_with_its_ttft(lines: list[str]) -> None:
    async with running([sim(0)], proxy={"access_log": "on"}) as rig:
        body = _chat(SECRET, max_tokens=8, stream=True)
        r = await rig.client.post("/v1/chat/completions", json=body)
        assert r.text.rstrip().endswith("data: [DONE]")
    (line,) = lines
    assert line.split()[1:3] == ["POST", "/v1/chat/completions"]
    fields = dict(part.split("=", 1) for part in line.split()[3:])
    assert fields["status"] == "200" and fields["pod"] == "sim-0"
    assert 0 < float(fields["ttft_ms"]) <= float(fields["latency_ms"])
    assert "end" not in fields  # sent to its last byte


@pytest.mark.parametrize("fmt", ["text", "json"])
async def test_the_prompt_text_never_appears_in_the_log(lines: list[str], fmt: str) -> None:
    proxy = {"access_log": "on", "access_log_format": fmt}
    async with running([sim(0)], proxy=proxy) as rig:
        await rig.client.post("/v1/chat/completions", json=_chat(SECRET, max_tokens=2))
        await rig.client.post(
            "/v1/completions", json={"model": MODEL, "prompt": SECRET, "max_tokens": 2}
        )
        stream = _chat(SECRET, max_tokens=2, stream=True)
        await rig.client.post("/v1/chat/completions", json=stream)
        bad = {"model": MODEL, "messages": SECRET}  # refused: still no prompt in the line
        assert (await rig.client.post("/v1/chat/completions", json=bad)).status_code == 400
    assert len(lines) == 4
    assert not [line for line in lines if SECRET in line or "launch" in line]


async def test_a_request_refused_before_routing_is_logged_with_its_reason(
    lines: list[str],
) -> None:
    async with running([sim(0)], proxy={"access_log": "on"}) as rig:
        r = await rig.client.post("/v1/chat/completions", json={"model": MODEL})
        assert r.status_code == 400
    (line,) = lines
    assert " status=400 reason=invalid_messages " in line
    assert "pod=" not in line and "prompt_tokens=" not in line


async def test_the_access_log_is_off_by_default(lines: list[str]) -> None:
    async with running([sim(0)]) as rig:
        assert Settings().proxy.access_log == "off"
        await rig.client.post("/v1/chat/completions", json=_chat("hi", max_tokens=2))
    assert lines == []


def test_a_sample_logs_the_drawn_share_of_requests() -> None:
    draws = iter([0.05, 0.5, 0.24, 0.9])
    access = AccessLog(True, 0.25, draw=lambda: next(draws))
    scope = {"method": "POST", "path": "/v1/completions"}
    logged = [access.begin(scope, 0.0) is not None for _ in range(4)]
    assert logged == [True, False, True, False]
    assert AccessLog(True, 0.0).begin(scope, 0.0) is None
    assert AccessLog(False, 1.0).begin(scope, 0.0) is None


def test_yaml_off_and_on_read_as_booleans_still_mean_off_and_on() -> None:
    assert Settings.model_validate({"proxy": {"access_log": True}}).proxy.access_log == "on"
    assert Settings.model_validate({"proxy": {"access_log": False}}).proxy.access_log == "off"
    with pytest.raises(ValueError, match="access_log"):
        Settings.model_validate({"proxy": {"access_log": "sometimes"}})


def test_a_text_value_with_a_space_or_a_quote_is_quoted() -> None:
    fields = {"ts": "t", "method": "POST", "path": "/x", "status": 200, "model": 'a "b" c'}
    assert format_line(fields, as_json=False) == 't POST /x status=200 model="a \\"b\\" c"'


async def test_a_w3c_trace_context_reaches_the_pod_unchanged(make_rig: Any) -> None:
    """Tracing is the pods' and the client's: the router forwards ``traceparent`` and
    ``tracestate`` as they came (vLLM's --otlp-traces-endpoint continues the trace)."""
    rig = await make_rig({"a": ok})
    trace = {
        "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
        "tracestate": "kvroute=t61rcWkgMzE",
    }
    r = await rig.client.post("/v1/chat/completions", json=CHAT, headers=trace)
    assert r.status_code == 200
    seen = rig.ups["a"].headers[0]
    assert seen["traceparent"] == trace["traceparent"]
    assert seen["tracestate"] == trace["tracestate"]
