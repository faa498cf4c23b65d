"""A tenant's stream is charged its completion tokens even when its client did not ask
for a usage event: the router asks the pod for one (``stream_options.include_usage``)
and takes it back out, so the client receives the stream it would have had."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx

from router.proxy.hidden_usage import HiddenUsage, asks_for_usage, usage_options
from tests.tenants.rig import (
    ADMIN,
    KEY_A,
    MODEL,
    auth,
    fleet,
    router,
    sample,
    settings_for,
    sim,
    two_tenants,
)

FP = "vllm-0.32.0-abcd1234"


def event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def vllm_stream(include_usage: bool, n: int = 1) -> bytes:
    """A chat stream shaped as vLLM 0.32 writes it (chat_completion/serving.py): the
    fingerprint on the terminal chunks without a usage event, on the usage event with."""
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 7, "model": "m"}
    out = [
        event({**head, "choices": [{"index": i, "delta": {"role": "assistant"}}]}) for i in range(n)
    ]
    for i in range(n):
        delta = {"index": i, "delta": {"content": 'say "finish_reason":"x"'}, "finish_reason": None}
        out.append(event({**head, "choices": [delta]}))
    for i in range(n):
        done: dict[str, Any] = {
            **head,
            "choices": [{"index": i, "delta": {}, "finish_reason": "stop"}],
        }
        if not include_usage:
            done["system_fingerprint"] = FP
        out.append(event(done))
    if include_usage:
        usage = {"prompt_tokens": 5, "completion_tokens": 3 * n, "total_tokens": 5 + 3 * n}
        out.append(event({**head, "choices": [], "usage": usage, "system_fingerprint": FP}))
    out.append(b"data: [DONE]\n\n")
    return b"".join(out)


def relay_in_pieces(data: bytes, size: int) -> tuple[bytes, HiddenUsage]:
    hidden = HiddenUsage()
    out = [hidden.feed(data[i : i + size]) for i in range(0, len(data), size)]
    out.append(hidden.flush())
    return b"".join(out), hidden


def test_the_usage_event_is_removed_and_the_fingerprint_goes_back_on_the_terminal_chunk() -> None:
    for n in (1, 2):
        asked, plain = vllm_stream(True, n), vllm_stream(False, n)
        for size in (1, 7, 64, len(asked)):
            out, hidden = relay_in_pieces(asked, size)
            assert out == plain, (n, size)
            assert hidden.usage is not None and hidden.usage.completion_tokens == 3 * n


def test_events_with_crlf_line_ends_are_found_too() -> None:
    crlf = vllm_stream(True).replace(b"\n\n", b"\r\n\r\n")
    out, hidden = relay_in_pieces(crlf, 3)
    assert out == vllm_stream(False).replace(b"\n\n", b"\r\n\r\n")
    assert hidden.usage is not None


def test_a_stream_without_a_usage_event_is_relayed_as_it_came() -> None:
    plain = vllm_stream(False)
    for size in (1, 5, len(plain)):
        out, hidden = relay_in_pieces(plain + b'data: {"trailing', size)
        assert out == plain + b'data: {"trailing' and hidden.usage is None


def test_only_streams_whose_client_did_not_ask_for_usage_are_asked() -> None:
    assert asks_for_usage("chat", {"stream": True})
    assert asks_for_usage("completion", {"stream": True, "stream_options": {}})
    assert asks_for_usage("chat", {"stream": True, "stream_options": {"include_usage": False}})
    assert not asks_for_usage("chat", {"stream": True, "stream_options": {"include_usage": True}})
    assert not asks_for_usage("chat", {"stream": False})
    assert not asks_for_usage("embedding", {"stream": True})
    assert not asks_for_usage("responses", {"stream": True})  # its events carry usage anyway
    assert not asks_for_usage("chat", {"stream": True, "stream_options": "bad"})
    # per-chunk usage stays off: vLLM ignores it without include_usage
    options = usage_options({"stream_options": {"continuous_usage_stats": True}})
    assert options == {"continuous_usage_stats": False, "include_usage": True}


def chat(**kw: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell me a story"}],
        "max_tokens": 48,
        "stream": True,
        **kw,
    }


_VOLATILE = re.compile(rb'"(id|created)":("[^"]*"|\d+)')


def normalised(stream: bytes) -> bytes:
    return _VOLATILE.sub(rb'"\1":0', stream)


async def stream_text(client: httpx.AsyncClient, url: str, body: Any, **kw: Any) -> bytes:
    async with client.stream("POST", url, json=body, **kw) as r:
        assert r.status_code == 200
        return b"".join([chunk async for chunk in r.aiter_raw()])


async def test_a_tenant_stream_without_include_usage_is_what_the_pod_sends_such_a_client() -> None:
    async with fleet([sim(0)]) as pods:
        async with httpx.AsyncClient(timeout=30) as direct:
            expected = await stream_text(direct, pods[0].url + "/v1/chat/completions", chat())
        assert b'"usage"' not in expected
        async with router(settings_for(pods, **two_tenants())) as client:
            got = await stream_text(client, "/v1/chat/completions", chat(), headers=auth(KEY_A))
            options = {"include_usage": False, "continuous_usage_stats": True}
            odd = await stream_text(
                client, "/v1/chat/completions", chat(stream_options=options), headers=auth(KEY_A)
            )
            asked = await stream_text(
                client,
                "/v1/chat/completions",
                chat(stream_options={"include_usage": True}),
                headers=auth(KEY_A),
            )
            m = (await client.get("/metrics", headers=auth(ADMIN))).text
    assert normalised(got) == normalised(expected)
    assert normalised(odd) == normalised(expected)
    assert b'"usage"' in asked  # a client that asks still gets its usage event
    # the three answers' completion tokens, the two hidden ones included
    assert sample(m, "kvroute_tenant_tokens_total", tenant="a", kind="completion") == 3 * 48


async def test_completion_tokens_of_a_stream_without_include_usage_are_charged() -> None:
    async with fleet([sim(0)]) as pods:
        async with router(settings_for(pods)) as probe:  # no tenants: one request's cost
            body = {**chat(), "stream": False}
            usage = (await probe.post("/v1/chat/completions", json=body)).json()["usage"]
        prompt, completion = usage["prompt_tokens"], usage["completion_tokens"]
        assert completion == 48
        # two prompts fit, but not two prompts and a completion: only charging the
        # completion refuses the second request
        limits = {"tokens_per_minute": 2 * prompt + completion / 2}
        async with router(settings_for(pods, **two_tenants(limits=limits))) as client:
            first = await stream_text(client, "/v1/chat/completions", chat(), headers=auth(KEY_A))
            assert b'"usage"' not in first
            r = await client.post("/v1/chat/completions", json=chat(), headers=auth(KEY_A))
            assert r.status_code == 429, r.text
            assert "tokens per minute" in r.json()["error"]["message"]
