"""RemoteTokenizer against a real HTTP /tokenize server on 127.0.0.1 (an engine stand-in
that tokenizes with the same HFTokenizer, answering as vLLM does)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from router.tokenize import ChatEncoder, TokenizeError, as_async, load_tokenizer
from router.tokenize.hf import HFTokenizer
from router.tokenize.remote import RemoteTokenizeError, RemoteTokenizer
from scoring.blocks import BlockHasher
from tests.fixtures.tokenizers.build import fixture_dirs
from tests.support.ports import refused_port

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
]


class _Engine(ThreadingHTTPServer):
    """``POST /tokenize`` like vLLM; ``mode`` switches to error answers."""

    daemon_threads = True

    def __init__(self, tok: HFTokenizer) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.tok = tok
        self.mode = "ok"
        self.bodies: list[dict[str, Any]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    server: _Engine

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        raw = self.rfile.read(int(self.headers.get("content-length", "0")))
        body = json.loads(raw)
        self.server.bodies.append(body)
        mode = self.server.mode
        if self.path != "/tokenize":
            self._send(404, b'{"detail": "Not Found"}')
        elif mode == "500":
            self._send(500, b'{"error": {"message": "engine exploded", "code": 500}}')
        elif mode == "garbage":
            self._send(200, b"<html>not json</html>", "text/html")
        elif mode == "no_tokens":
            self._send(200, b'{"count": 3}')
        elif "messages" in body:
            bad_role = any(m.get("role") == "narrator" for m in body["messages"])
            if bad_role:
                err = {"error": {"message": "unsupported role: narrator", "code": 400}}
                self._send(400, json.dumps(err).encode())
                return
            tok = self.server.tok
            chat_args: dict[str, Any] = dict(
                tools=body.get("tools"),
                add_generation_prompt=body.get("add_generation_prompt", True),
                chat_template_kwargs=body.get("chat_template_kwargs"),
            )
            if body.get("add_special_tokens"):  # vLLM: the rendered text, as a prompt
                text = tok.render_chat(body["messages"], **chat_args)
                ids = tok.encode_text(text, add_special_tokens=True)
            else:
                ids = tok.encode_chat(body["messages"], **chat_args)
            self._send(200, json.dumps({"tokens": ids, "count": len(ids)}).encode())
        else:
            ids = self.server.tok.encode_prompt(body["prompt"])
            self._send(200, json.dumps({"tokens": ids, "count": len(ids)}).encode())


@pytest.fixture(scope="module")
def tok() -> HFTokenizer:
    return HFTokenizer.from_dir(fixture_dirs()["llama3"])


@pytest.fixture
def engines(tok: HFTokenizer) -> Iterator[list[_Engine]]:
    servers = [_Engine(tok), _Engine(tok)]
    threads = [threading.Thread(target=s.serve_forever, args=(0.05,), daemon=True) for s in servers]
    for t in threads:
        t.start()
    try:
        yield servers
    finally:
        for s in servers:
            s.shutdown()
            s.server_close()


def closed_port_url() -> str:
    return f"http://127.0.0.1:{refused_port()}"


def test_async_chat_and_prompt_ids_come_from_the_pod(
    tok: HFTokenizer, engines: list[_Engine]
) -> None:
    remote = RemoteTokenizer(engines[0].url, model="tiny")
    kwargs = {"date_string": "1 Jan 2026"}

    async def run() -> tuple[list[int], list[int]]:
        try:
            chat = await remote.aencode_chat(MESSAGES, chat_template_kwargs=kwargs)
            prompt = await remote.aencode_prompt("hello world")
            return chat, prompt
        finally:
            await remote.aclose()

    chat, prompt = asyncio.run(run())
    assert chat == tok.encode_chat(MESSAGES, chat_template_kwargs=kwargs)
    assert prompt == tok.encode_prompt("hello world")
    first = engines[0].bodies[0]
    assert first == {
        "messages": MESSAGES,
        "add_generation_prompt": True,
        "model": "tiny",
        "chat_template_kwargs": kwargs,
    }
    assert engines[0].bodies[1] == {"prompt": "hello world", "model": "tiny"}


def test_tools_are_forwarded_to_the_pod(engines: list[_Engine]) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    RemoteTokenizer(engines[0].url).encode_chat(MESSAGES, tools=tools, add_generation_prompt=False)
    assert engines[0].bodies[-1]["tools"] == tools
    assert engines[0].bodies[-1]["add_generation_prompt"] is False


def test_a_responses_request_asks_the_pod_for_the_chat_with_special_tokens(
    tok: HFTokenizer, engines: list[_Engine]
) -> None:
    remote = RemoteTokenizer(engines[0].url, model="tiny")
    hasher = BlockHasher(4, "tiny")

    async def run() -> list[int]:
        try:
            enc = await ChatEncoder(remote, hasher).aencode_responses(MESSAGES)
            return enc.token_ids
        finally:
            await remote.aclose()

    ids = asyncio.run(run())
    assert engines[0].bodies[-1]["add_special_tokens"] is True
    # what a local tokenizer computes for the same request, as vLLM's Responses path does
    assert ids == ChatEncoder(tok, hasher).encode_responses(MESSAGES).token_ids
    # the Llama-3 template starts with its BOS, and tokenizing adds another one
    chat = tok.encode_chat(MESSAGES)
    assert ids == [ids[0], *chat] and ids[0] == chat[0]


def test_sync_methods_work_for_offline_tools(tok: HFTokenizer, engines: list[_Engine]) -> None:
    remote = load_tokenizer("remote:" + engines[0].url, model="tiny")
    assert remote.encode_chat(
        MESSAGES, chat_template_kwargs={"date_string": "x"}
    ) == tok.encode_chat(MESSAGES, chat_template_kwargs={"date_string": "x"})
    assert remote.encode_prompt("abc") == tok.encode_prompt("abc")
    assert remote.approximate is False


def test_engine_4xx_is_reported_with_its_message_and_not_retried(engines: list[_Engine]) -> None:
    remote = RemoteTokenizer([engines[0].url, engines[1].url])
    with pytest.raises(RemoteTokenizeError, match="unsupported role: narrator") as err:
        remote.encode_chat([{"role": "narrator", "content": "x"}])
    assert err.value.status == 400
    assert engines[1].bodies == []


def test_5xx_and_unreachable_pods_fail_over_to_the_next_url(
    tok: HFTokenizer, engines: list[_Engine]
) -> None:
    engines[0].mode = "500"
    remote = RemoteTokenizer([closed_port_url(), engines[0].url, engines[1].url])

    async def run() -> list[int]:
        try:
            return await remote.aencode_prompt("fail over")
        finally:
            await remote.aclose()

    assert asyncio.run(run()) == tok.encode_prompt("fail over")
    assert len(engines[0].bodies) == 1 and len(engines[1].bodies) == 1


def test_all_pods_failing_raises_the_last_error(engines: list[_Engine]) -> None:
    engines[0].mode = "500"
    with pytest.raises(RemoteTokenizeError, match="engine exploded") as err:
        RemoteTokenizer([closed_port_url(), engines[0].url]).encode_prompt("x")
    assert err.value.status == 500
    with pytest.raises(RemoteTokenizeError, match="ConnectError") as err:
        RemoteTokenizer(closed_port_url(), timeout=2).encode_prompt("x")
    assert err.value.status is None


@pytest.mark.parametrize(("mode", "match"), [("garbage", "non-JSON"), ("no_tokens", "no 'tokens'")])
def test_malformed_answers_are_clear_errors(engines: list[_Engine], mode: str, match: str) -> None:
    engines[0].mode = mode
    with pytest.raises(RemoteTokenizeError, match=match):
        RemoteTokenizer(engines[0].url).encode_prompt("x")


def test_bad_input_is_rejected_before_any_request(engines: list[_Engine]) -> None:
    remote = RemoteTokenizer(engines[0].url)
    with pytest.raises(TokenizeError, match="non-empty list"):
        remote.encode_chat([])
    with pytest.raises(TokenizeError, match="prompt must be a string"):
        remote.encode_prompt(5)  # type: ignore[arg-type]
    assert engines[0].bodies == []


def test_chat_encoder_awaits_the_remote_tokenizer_and_hashes_blocks(
    tok: HFTokenizer, engines: list[_Engine]
) -> None:
    hasher = BlockHasher(4)
    remote = RemoteTokenizer(engines[0].url)
    encoder = ChatEncoder(remote, hasher)
    kwargs = {"date_string": "2 Feb 2026"}

    async def run() -> Any:
        try:
            return await encoder.aencode_chat(MESSAGES, chat_template_kwargs=kwargs, lora="a")
        finally:
            await remote.aclose()

    got = asyncio.run(run())
    expected = tok.encode_chat(MESSAGES, chat_template_kwargs=kwargs)
    assert got.token_ids == expected
    assert got.block_keys == hasher.keys(expected, lora="a")
    assert as_async(remote) is remote


def test_as_async_wraps_local_tokenizers(tok: HFTokenizer) -> None:
    wrapped = as_async(tok, offload_chars=10)

    async def run() -> tuple[list[int], list[int]]:
        big = [{"role": "user", "content": "long " * 100}]
        return await wrapped.aencode_chat(big), await wrapped.aencode_prompt("short")

    chat, prompt = asyncio.run(run())
    assert chat == tok.encode_chat([{"role": "user", "content": "long " * 100}])
    assert prompt == tok.encode_prompt("short")
    assert wrapped.name == tok.name and wrapped.approximate is False


def test_check_against_engine_passes_when_ids_agree(
    tok: HFTokenizer, engines: list[_Engine]
) -> None:
    from router.tokenize.verify import SAMPLE_CHATS, SAMPLE_PROMPTS, check_against_engine

    remote = RemoteTokenizer(engines[0].url)
    result = asyncio.run(check_against_engine(tok, remote))
    assert result.ok
    assert result.checked == len(SAMPLE_CHATS) + len(SAMPLE_PROMPTS)
    assert result.mismatches == [] and result.errors == []


def test_check_against_engine_reports_a_mismatch_loudly(
    engines: list[_Engine], caplog: pytest.LogCaptureFixture
) -> None:
    from router.tokenize.verify import check_against_engine

    other = HFTokenizer.from_dir(fixture_dirs()["chatml"])  # not the engine's tokenizer
    with caplog.at_level("ERROR"):
        result = asyncio.run(check_against_engine(other, RemoteTokenizer(engines[0].url)))
    assert not result.ok
    assert result.mismatches and "first difference at token" in result.mismatches[0]
    assert "does NOT match the engine" in caplog.text


def test_check_against_engine_counts_requests_it_cannot_compare(
    tok: HFTokenizer, engines: list[_Engine]
) -> None:
    from router.tokenize.verify import check_against_engine

    chats = [[{"role": "narrator", "content": "x"}], [{"role": "user", "content": "fine"}]]
    result = asyncio.run(
        check_against_engine(tok, RemoteTokenizer(engines[0].url), chats=chats, prompts=[])
    )
    assert result.checked == 1 and result.ok
    assert len(result.errors) == 1 and "narrator" in result.errors[0]
