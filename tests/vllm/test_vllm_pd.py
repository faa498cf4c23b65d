"""Live: prefill/decode disaggregation between two real vLLM CPU engines through kvroute.

Opt-in (``pytest -m vllm tests/vllm/test_vllm_pd.py``).  Both engines run vLLM's
``NixlConnector`` (``kv_role: kv_both``, ``kv_buffer_device: cpu``; the ``nixl`` wheel's
UCX backend moves the blocks over loopback; docs/vllm.md says how it was set up).  The
router is told ``vllm-p`` is a ``prefill`` pod and ``vllm-d`` a ``decode`` pod, with the
default split rule (scoring/pd.py): a long uncached prompt on this idle fleet is split.

For each request kind the test checks, from the engines' own counters:

* the prefill engine ran the request (``vllm:request_success_total`` +1);
* the decode engine did not recompute the prompt: its
  ``vllm:prompt_tokens_by_source_total{source="external_kv_transfer"}`` rose by the
  prompt's tokens and ``{source="local_compute"}`` by less than a block;
* the answer (temperature 0) is the one the prefill engine gives to the same request
  sent to it directly after ``POST /reset_prefix_cache`` (a full local computation).

The kinds: chat, streamed chat, completion, and a new ``/v1/responses`` request.

Skipped when the engine, the model or the ``nixl`` package in the engine's venv is
missing.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.vllm.conftest import EngineFactory
from tests.vllm.test_vllm_routing import running_router
from tools.capture_vllm_events import VLLM_ROOT, EngineProcess, free_port

pytestmark = pytest.mark.vllm

MODEL = "tiny-llama"
BLOCK = 32
KV_TRANSFER = '{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_buffer_device":"cpu"}'


def _nixl_missing() -> str | None:
    python = VLLM_ROOT / "venv" / "bin" / "python"
    if not python.exists():
        return None  # the engine factory skips with its own reason
    ok = subprocess.run([str(python), "-c", "import nixl._api"], capture_output=True, timeout=120)
    if ok.returncode != 0:
        return f"nixl is not importable in {python} (pip install nixl-cu12 nixl)"
    return None


def _doc(topic: str, words: int = 200) -> str:
    """About 4 tokens a word: ~800 tokens, far past the 256-token split threshold."""
    return " ".join(f"{topic}{i}" for i in range(words))


def _samples(text: str, name: str) -> dict[str, float]:
    """Every sample of ``name`` in a Prometheus exposition, keyed by its label text."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith((name + "{", name + " ")):
            head, value = line.rsplit(" ", 1)
            out[head[len(name) :]] = float(value)
    return out


async def _counter(engine: EngineProcess, name: str, label: str = "") -> float:
    async with httpx.AsyncClient(timeout=10) as c:
        text = (await c.get(engine.base_url + "/metrics")).text
    return sum(v for k, v in _samples(text, name).items() if label in k)


async def _by_source(engine: EngineProcess) -> dict[str, float]:
    return {
        src: await _counter(engine, "vllm:prompt_tokens_by_source_total", f'source="{src}"')
        for src in ("local_compute", "external_kv_transfer")
    }


@pytest.fixture(scope="module")
def engines(engine: EngineFactory) -> list[EngineProcess]:
    reason = _nixl_missing()
    if reason:
        pytest.skip(reason)
    specs = []
    for name in ("pd-prefill", "pd-decode"):
        env = (
            ("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1"),
            ("VLLM_NIXL_SIDE_CHANNEL_PORT", str(free_port())),
        )
        specs.append((name, {"extra_args": ("--kv-transfer-config", KV_TRANSFER), "env": env}))
    return engine.group(specs)


@pytest.fixture
async def router(engines: list[EngineProcess]) -> AsyncIterator[httpx.AsyncClient]:
    pods = [
        {
            "name": name,
            "url": e.base_url,
            "events_endpoint": e.pub_endpoint,
            "replay_endpoint": e.replay_endpoint,
            "models": [MODEL],
            "role": role,
        }
        for name, role, e in (("vllm-p", "prefill", engines[0]), ("vllm-d", "decode", engines[1]))
    ]
    async with running_router(pods) as client:
        yield client


async def _reference(engine: EngineProcess, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` sent straight to ``engine`` with its prefix cache emptied first."""
    async with httpx.AsyncClient(base_url=engine.base_url, timeout=120) as c:
        (await c.post("/reset_prefix_cache")).raise_for_status()
        r = await c.post(path, json=body)
        r.raise_for_status()
        out: dict[str, Any] = r.json()
        return out


def _text(answer: dict[str, Any]) -> str:
    if answer.get("object") == "response":
        return "".join(
            part["text"]
            for item in answer["output"]
            if item["type"] == "message"
            for part in item["content"]
            if part["type"] == "output_text"
        )
    choice = answer["choices"][0]
    return str(choice["message"]["content"] if "message" in choice else choice["text"])


def _streamed_text(sse: str) -> str:
    parts = []
    for line in sse.splitlines():
        if line.startswith("data:") and line.strip() != "data: [DONE]":
            for choice in json.loads(line[5:])["choices"]:
                parts.append(choice.get("delta", {}).get("content") or choice.get("text") or "")
    return "".join(parts)


CASES = [
    pytest.param(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Summarise: " + _doc("alpha")}]},
        False,
        id="chat",
    ),
    pytest.param(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Summarise: " + _doc("bravo")}]},
        True,
        id="chat-stream",
    ),
    pytest.param(
        "/v1/completions", {"prompt": "Notes: " + _doc("charlie")}, False, id="completion"
    ),
    pytest.param("/v1/responses", {"input": "Summarise: " + _doc("delta")}, False, id="responses"),
]


@pytest.mark.parametrize(("path", "body", "stream"), CASES)
async def test_a_long_prompt_is_prefilled_on_one_engine_and_decoded_on_the_other_unchanged(
    engines: list[EngineProcess],
    router: httpx.AsyncClient,
    path: str,
    body: dict[str, Any],
    stream: bool,
) -> None:
    prefill, decode = engines
    cap = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
    request = {"model": MODEL, cap: 12, "temperature": 0, **body}
    plan = (await router.post("/v1/route", json=request)).json()["pd"]
    assert (plan["reason"], plan["prefill_pod"]) == ("split", "vllm-p"), plan  # default rule
    prompt_tokens = int(plan["predicted"]["uncached_decode_tokens"])

    served = await _counter(prefill, "vllm:request_success_total")
    before = await _by_source(decode)
    sent = (
        {**request, "stream": True, "stream_options": {"include_usage": True}}
        if stream
        else request
    )
    r = await router.post(path, json=sent)
    assert r.status_code == 200, r.text
    assert (r.headers["x-kvroute-prefill-pod"], r.headers["x-kvroute-pod"]) == ("vllm-p", "vllm-d")
    await asyncio.sleep(0.5)  # the engines' counters are updated after the answer
    after = await _by_source(decode)

    assert await _counter(prefill, "vllm:request_success_total") == served + 1
    pulled = after["external_kv_transfer"] - before["external_kv_transfer"]
    computed = after["local_compute"] - before["local_compute"]
    assert pulled >= prompt_tokens - BLOCK, (pulled, prompt_tokens)
    assert computed < BLOCK, computed

    answer = _streamed_text(r.text) if stream else _text(r.json())
    assert answer and answer == _text(await _reference(prefill, path, request))

    metrics = (await router.get("/metrics")).text
    assert sum(_samples(metrics, "kvroute_pd_fallbacks_total").values()) == 0
