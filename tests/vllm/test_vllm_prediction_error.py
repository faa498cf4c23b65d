"""Live: the router's predicted cached tokens against what a real vLLM engine reports.

Opt-in (``pytest -m vllm tests/vllm``).  One vLLM CPU engine started with
``--enable-prompt-tokens-details``, so its answers carry
``usage.prompt_tokens_details.cached_tokens``; the router (KV events dialled) counts them
next to its own prediction (``kvroute_engine_cached_tokens_total``,
``kvroute_cache_prediction_error_tokens_total{direction}``).  A follow-up that extends a
prompt the engine already holds: the engine's count is the router's prediction, no error
either way.  (A drifted index showing as under-predicted is tested on sim pods:
tests/router/test_answers.py.)
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from tests.vllm.conftest import EngineFactory
from tests.vllm.test_vllm_routing import MODEL, running_router
from tools.capture_vllm_events import EngineProcess

pytestmark = pytest.mark.vllm

PREFIX = "The router predicts what the engine will find in its cache. " * 12


def _body(question: str) -> dict[str, Any]:
    return {"model": MODEL, "prompt": PREFIX + question, "max_tokens": 1, "temperature": 0}


def _counter(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def detailed(engine: EngineFactory) -> EngineProcess:
    (proc,) = engine.many(
        ["details-0"], hash_algo="sha256", extra_args=("--enable-prompt-tokens-details",)
    )
    return proc


async def test_the_engines_reported_hits_match_the_routers_prediction(
    detailed: EngineProcess,
) -> None:
    pods = [
        {
            "name": "vllm-0",
            "url": detailed.base_url,
            "events_endpoint": detailed.pub_endpoint,
            "replay_endpoint": detailed.replay_endpoint,
            "models": [MODEL],
        }
    ]
    async with running_router(pods) as router:
        first = await router.post("/v1/completions", json=_body("first"))
        assert first.status_code == 200, first.text
        deadline = time.monotonic() + 30
        while True:  # until the engine's BlockStored events reach the index
            plan = (await router.post("/v1/route", json=_body("second"))).json()
            if plan["candidates"][0]["cached_tokens"] > 0:
                break
            assert time.monotonic() < deadline, plan
            await asyncio.sleep(0.3)
        second = await router.post("/v1/completions", json=_body("second"))
        reported = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert reported > 0
        text = (await router.get("/metrics")).text
        assert _counter(text, "kvroute_engine_cached_tokens_total", pod="vllm-0") == reported
        assert _counter(text, "kvroute_cache_prediction_error_tokens_total", pod="vllm-0") == 0
