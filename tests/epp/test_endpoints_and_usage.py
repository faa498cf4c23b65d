"""Pods as the proxy names them (``ip:port`` from the registry's URLs), and the usage
the picker reads in an answer on its way through."""

from __future__ import annotations

import json

import pytest

from router.epp.endpoints import Endpoints, endpoint_of
from router.fleet.pods import PodRegistry, PodSpec
from router.usage import JSON_LIMIT, SSE_TAIL, UsageReader
from tests.epp import client as C
from tests.epp.fleet import MODEL, endpoint, running_epp, settings_for, sim_pods


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://10.0.0.7:8000", "10.0.0.7:8000"),
        ("http://10.0.0.7", "10.0.0.7:80"),
        ("https://10.0.0.7", "10.0.0.7:443"),
        ("http://[fd00::7]:8000/", "[fd00::7]:8000"),
        ("http://vllm-0.vllm:8000", None),  # a host name: the proxy needs an address
        ("http://localhost:8000", None),
    ],
)
def test_a_pod_url_gives_its_ip_port_endpoint(url: str, expected: str | None) -> None:
    assert endpoint_of(url) == expected


def test_endpoints_follow_the_registry_both_ways() -> None:
    registry = PodRegistry()
    endpoints = Endpoints(registry)
    registry.set_pods([PodSpec("a", "http://10.0.0.1:8000"), PodSpec("b", "http://vllm-b:8000")])
    assert endpoints.of("a") == "10.0.0.1:8000" and endpoints.pod("10.0.0.1:8000") == "a"
    assert endpoints.unaddressable == {"b"}
    registry.set_pods([PodSpec("a", "http://10.0.0.9:8000")])  # a moved, b left
    assert endpoints.of("a") == "10.0.0.9:8000" and endpoints.pod("10.0.0.1:8000") is None
    assert endpoints.unaddressable == set()


def test_a_subset_entry_without_a_port_allows_every_port_of_that_ip() -> None:
    registry = PodRegistry()
    endpoints = Endpoints(registry)
    registry.set_pods(
        [
            PodSpec("a", "http://10.0.0.1:8000"),
            PodSpec("a2", "http://10.0.0.1:8001"),
            PodSpec("b", "http://10.0.0.2:8000"),
            PodSpec("v6", "http://[fd00::1]:8000"),
        ]
    )
    assert endpoints.allowed(["10.0.0.1"]) == {"a", "a2"}
    assert endpoints.allowed(["10.0.0.1:8001", "[fd00::1]:8000"]) == {"a2", "v6"}
    assert endpoints.allowed(["fd00::1"]) == {"v6"}
    assert endpoints.allowed([]) == set()


async def test_a_pod_without_an_ip_is_never_picked_and_is_counted() -> None:
    async with sim_pods(2) as pods:
        named = {"name": "named-1", "url": pods[1].url.replace("127.0.0.1", "localhost")}
        static = [{"name": pods[0].name, "url": pods[0].url, "models": [MODEL]}]
        static.append({**named, "models": [MODEL]})
        settings = settings_for(pods, discovery={"static": static}, events={"enabled": False})
        async with running_epp(settings, endpoints=2) as (server, channel):
            picks = []
            for i in range(4):
                stream = C.Stream(channel)
                body = {"model": MODEL, "messages": [{"role": "user", "content": f"q{i}"}]}
                await stream.send(
                    C.request_headers("/v1/chat/completions"),
                    C.request_body(json.dumps(body).encode(), True),
                )
                answer, _ = await stream.read_request_pick()
                picks.append(C.destination_metadata(answer))
                await stream.close()
            text = server.picker.metrics.render().decode()
    assert picks == [endpoint(pods[0])] * 4
    assert "kvroute_epp_unaddressable_pods 1.0" in text


def test_the_usage_of_a_json_answer_is_read_at_its_end() -> None:
    reader = UsageReader(event_stream=False)
    answer = {
        "id": "x",
        "usage": {
            "prompt_tokens": 120,
            "completion_tokens": 8,
            "prompt_tokens_details": {"cached_tokens": 96},
        },
    }
    raw = json.dumps(answer).encode()
    for i in range(0, len(raw), 7):  # in pieces, as it streams through
        reader.feed(raw[i : i + 7])
    usage = reader.usage()
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (120, 8, 96)


def test_the_usage_of_a_stream_is_its_last_usage_event_and_only_a_tail_is_kept() -> None:
    reader = UsageReader(event_stream=True)
    for i in range(2000):  # far more than the tail
        reader.feed(b'data: {"choices": [{"delta": {"content": "%d"}}]}\n\n' % i)
    reader.feed(b'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 9}}\n\n')
    reader.feed(b"data: [DONE]\n\n")
    assert len(reader.body()) <= SSE_TAIL + 200
    usage = reader.usage()
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (5, 9)


def test_a_responses_api_event_s_usage_is_read() -> None:
    reader = UsageReader(event_stream=True)
    event = {
        "type": "response.completed",
        "response": {"usage": {"input_tokens": 11, "output_tokens": 3}},
    }
    reader.feed(b"event: response.completed\ndata: " + json.dumps(event).encode() + b"\n\n")
    usage = reader.usage()
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (11, 3)


def test_an_answer_too_large_or_without_usage_has_none() -> None:
    big = UsageReader(event_stream=False)
    big.feed(b'{"usage": {"prompt_tokens": 1, "completion_tokens": 1}, "pad": "')
    big.feed(b"x" * (JSON_LIMIT + 1))
    big.feed(b'"}')
    plain = UsageReader(event_stream=False)
    plain.feed(b'{"object": "list", "data": []}')
    broken = UsageReader(event_stream=False)
    broken.feed(b"{not json")
    assert big.usage() is None and plain.usage() is None and broken.usage() is None
