"""What the proxy reads in the answers it relays: the cached tokens the pod reports,
set against what the index predicted (so a drifted index shows at once), and the output
tokens a learning policy is told of."""

from __future__ import annotations

import json
import re

from prometheus_client import generate_latest

from router.decision.request import Routed
from router.metrics import RouterMetrics
from router.proxy import answers
from scoring.policies.base import Decision, PodView, RouteRequest
from tests.router.app_rig import MODEL, running, sim
from tests.support.aio import wait_until

SYSTEM = "You answer in one line. " * 40  # several blocks every request shares


def _body(question: str, **extra: object) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question},
        ],
        "max_tokens": 8,
        **extra,
    }


def _counter(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def test_the_pods_reported_cached_tokens_are_counted_next_to_the_prediction() -> None:
    async with running([sim(0, kv_events=True)], events=True) as rig:
        first = await rig.client.post("/v1/chat/completions", json=_body("q1"))
        assert first.status_code == 200
        pod = first.headers["x-kvroute-pod"]

        async def indexed() -> bool:
            r = await rig.client.post("/v1/route", json=_body("q2"))
            return bool(r.json()["candidates"][0]["cached_tokens"])

        await wait_until(indexed, "the first prompt's blocks to reach the index")
        second = await rig.client.post("/v1/chat/completions", json=_body("q2"))
        reported = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert reported > 0
        text = await rig.metrics()
        assert _counter(text, "kvroute_engine_cached_tokens_total", pod=pod) >= reported
        # the index knew exactly what the pod held: no error either way
        assert _counter(text, "kvroute_cache_prediction_error_tokens_total", pod=pod) == 0


async def test_a_pod_the_index_lost_shows_as_under_predicted() -> None:
    async with running([sim(0, kv_events=True)], events=True) as rig:
        r = await rig.client.post("/v1/chat/completions", json=_body("q1"))
        pod = r.headers["x-kvroute-pod"]

        async def predicted(question: str) -> tuple[int, int]:
            """(cached tokens, speculative blocks) /v1/route predicts on the pod."""
            route = await rig.client.post("/v1/route", json=_body(question))
            c = next(c for c in route.json()["candidates"] if c["pod"] == pod)
            return int(c["cached_tokens"]), int(c["speculative_blocks"])

        async def indexed() -> bool:
            cached, speculative = await predicted("q2")
            return cached > 0 and speculative == 0

        # the shared blocks announced by the pod's events (and the speculative entries
        # of a pod that had not published yet confirmed and gone)
        await wait_until(indexed, "the pod's blocks to reach the index")
        await rig.gateway.index.clear_pod(pod)  # the index drifted: it forgot the pod
        assert await predicted("q2") == (0, 0)
        again = await rig.client.post("/v1/chat/completions", json=_body("q2"))
        reported = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert reported > 0
        text = await rig.metrics()
        under = _counter(
            text, "kvroute_cache_prediction_error_tokens_total", pod=pod, direction="under"
        )
        assert under == reported


async def test_a_streamed_answers_usage_is_read_when_the_client_asked_for_it() -> None:
    async with running([sim(0, kv_events=True)], events=True) as rig:
        for q in ("q1", "q2", "q3"):
            body = _body(q, stream=True, stream_options={"include_usage": True})
            r = await rig.client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        text = await rig.metrics()
        assert re.search(r"^kvroute_engine_cached_tokens_total\{", text, re.M), text[:2000]


async def test_a_learning_policy_hears_the_output_tokens_of_each_answer() -> None:
    async with running([sim(0)], policy="measured") as rig:
        policy = rig.gateway.policy
        probe = RouteRequest("probe", MODEL, 10, [], 16)
        before = policy.expected_output(probe)  # type: ignore[attr-defined]
        for i in range(20):
            r = await rig.client.post("/v1/chat/completions", json=_body(f"q{i}"))
            assert r.json()["usage"]["completion_tokens"] == 8
        after = policy.expected_output(probe)  # type: ignore[attr-defined]
        assert after < before  # moved from its prior toward the 8 tokens each answer had


def _routed(pod: str) -> Routed:
    route = RouteRequest("r1", MODEL, 40, [1, 2], 16)
    view = PodView(pod, {"GPU": 2})
    return Routed("completion", {}, MODEL, False, route, Decision(pod, {}), [pod], {pod: view})


def _completion(usage: dict[str, object]) -> bytes:
    return json.dumps({"id": "c1", "choices": [{"text": "ok"}], "usage": usage}).encode()


def test_an_answer_reporting_cached_tokens_is_counted_whether_or_not_output_is_wanted() -> None:
    body = _completion(
        {
            "prompt_tokens": 40,
            "completion_tokens": 3,
            "prompt_tokens_details": {"cached_tokens": 16},
        }
    )
    for want in (True, False):
        metrics = RouterMetrics()
        answer = answers.of_body(metrics, _routed("p0"), "p0", 200, body, want_output=want)
        assert answer.ok and answer.output_tokens == 3
        text = generate_latest(metrics.registry).decode()
        assert _counter(text, "kvroute_engine_cached_tokens_total", pod="p0") == 16
        # the index predicted 2 blocks (32 tokens), the pod served 16 from its cache
        over = _counter(text, "kvroute_cache_prediction_error_tokens_total", direction="over")
        assert over == 16


def test_the_output_tokens_of_an_answer_without_cached_tokens_are_read_only_when_wanted() -> None:
    body = _completion({"prompt_tokens": 40, "completion_tokens": 3})
    wanted = answers.of_body(RouterMetrics(), _routed("p0"), "p0", 200, body, want_output=True)
    assert wanted.ok and wanted.output_tokens == 3
    unwanted = answers.of_body(RouterMetrics(), _routed("p0"), "p0", 200, body, want_output=False)
    assert unwanted.ok and unwanted.output_tokens is None  # nothing to count: not decoded
