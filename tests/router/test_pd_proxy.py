"""The proxy's prefill/decode orchestration (router/proxy/disagg.py), over real HTTP on
loopback: simulated pods in roles prefill and decode (the fleet's ``prefill_pods`` /
``decode_pods``), their KV events on real ZMQ, the router in this loop.

Most tests set ``pd.params.always_split`` (vLLM's toy proxy: every request a prefill pod
can take is split), so that a test's requests split whatever the pods' load; the default
rule (a long uncached prompt splits, a short one or a backed-up prefill pool goes
direct) has its own tests.  Which pod a
request goes to is steered with request ids that ``POST /v1/route`` ranks as the test
needs (decisions are deterministic per request id).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from router.config import FleetSettings, Settings
from router.fleet.embedded import sim_settings, start_pods, static_pods, stop_pods
from router.proxy.app import create_app
from router.proxy.gateway import Gateway
from router.proxy.serve import RunningServer
from router.sim.pod import SimPod
from tests.router.test_e2e import settle
from tests.support.aio import wait_until
from tests.support.ports import refused_port

MODEL = "sim-model"
#: ~1,000 tokens with the builtin (byte) tokenizer: far past min_uncached_tokens (256)
DOC = "The prefill pod computes the prompt and the decode pod pulls its blocks. " * 14
SPLIT = {"params": {"always_split": True}}


@dataclass
class Harness:
    gateway: Gateway
    client: httpx.AsyncClient
    pods: dict[str, SimPod]

    def sample(self, name: str, **labels: str) -> float:
        return self.gateway.metrics.registry.get_sample_value(name, labels) or 0.0

    async def pod_metric(self, pod: str, name: str, **labels: str) -> float:
        """A metric of a sim pod's own /metrics (summed over matching series)."""
        r = await self.client.get(self.pods[pod].url + "/metrics")
        total = 0.0
        for line in r.text.splitlines():
            if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
                head = line.split(" ")[0]
                if head == name or head.startswith(name + "{"):
                    total += float(line.rsplit(" ", 1)[1])
        return total

    async def route(self, body: dict[str, Any], rid: str) -> dict[str, Any]:
        r = await self.client.post("/v1/route", json=body, headers={"x-request-id": rid})
        assert r.status_code == 200, r.text
        return dict(r.json())

    async def rid_where(self, body: dict[str, Any], **want: str) -> str:
        """A request id whose P/D plan has ``want`` (e.g. ``prefill_pod="dead-p"``)."""
        for i in range(400):
            rid = f"req-{i}"
            pd = (await self.route(body, rid))["pd"]
            if all(pd[k] == v for k, v in want.items()):
                return rid
        raise AssertionError(f"no request id gives {want}")


def dead(name: str, role: str) -> dict[str, Any]:
    """A pod nobody listens on (connect refused)."""
    return {
        "name": name,
        "url": f"http://127.0.0.1:{refused_port()}",
        "models": [MODEL],
        "role": role,
    }


@contextlib.asynccontextmanager
async def pd_router(
    *,
    prefill: int = 2,
    decode: int = 2,
    both: int = 0,
    sim: dict[str, dict[str, Any]] | None = None,
    extra: list[dict[str, Any]] | None = None,
    roles: dict[str, str] | None = None,
    **overrides: Any,
) -> AsyncIterator[Harness]:
    """``prefill`` + ``decode`` (+ ``both``) sim pods (``sim``: per-pod settings),
    ``extra`` static entries, ``roles``: the role the *router* is told per pod."""
    fleet = FleetSettings(pods=both, prefill_pods=prefill, decode_pods=decode)
    names = [n for n, _ in fleet.roles()]
    configs = [
        sim_settings(fleet, i, time_scale=1.0, **(sim or {}).get(n, {}))
        for i, n in enumerate(names)
    ]
    pods = await start_pods(configs)
    try:
        static = [p.model_dump() for p in static_pods(pods)]
        for entry in static:
            if roles and entry["name"] in roles:
                entry["role"] = roles[entry["name"]]
        settings = Settings.model_validate(
            {
                "discovery": {"static": static + (extra or [])},
                "fleet": {"enabled": False},
                "health": {"enabled": False},
                **overrides,
            }
        )
        app = create_app(settings)
        async with (
            RunningServer(app) as server,
            httpx.AsyncClient(base_url=server.url, timeout=30.0) as client,
        ):
            yield Harness(app.state.gateway, client, {p.name: p for p in pods})
    finally:
        await stop_pods(pods)


def chat(text: str = DOC, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 8, **kw}


def completion(text: str = DOC, **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": text, "max_tokens": 8, **kw}


def sse_events(text: str) -> list[str]:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


# -- no roles ----------------------------------------------------------------------------


async def test_a_fleet_without_roles_is_routed_by_the_policy_as_before() -> None:
    async with pd_router(prefill=0, decode=0, both=2) as h:
        explained = await h.route(chat(), "req-0")
        assert "pd" not in explained
        r = await h.client.post("/v1/chat/completions", json=chat())
        assert r.status_code == 200, r.text
        assert "x-kvroute-prefill-pod" not in r.headers
        assert r.headers["x-kvroute-pod"] in ("sim-0", "sim-1")
        assert "kvroute_pd_decisions_total{" not in h.gateway.metrics.render().decode()
        assert "kv_transfer_params" not in r.json()


# -- the happy path ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["chat", "completion"])
@pytest.mark.parametrize("stream", [False, True])
async def test_a_split_request_is_prefilled_on_a_prefill_pod_and_decoded_on_a_decode_pod(
    kind: str, stream: bool
) -> None:
    async with pd_router(pd=SPLIT) as h:
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        make = chat if kind == "chat" else completion
        body = (
            make(stream=stream, max_completion_tokens=8) if kind == "chat" else make(stream=stream)
        )
        if stream:
            body["stream_options"] = {"include_usage": True}
        r = await h.client.post(path, json=body)
        assert r.status_code == 200, r.text
        prefill_pod, decode_pod = r.headers["x-kvroute-prefill-pod"], r.headers["x-kvroute-pod"]
        assert prefill_pod in ("sim-p0", "sim-p1") and decode_pod in ("sim-d0", "sim-d1")
        if stream:
            events = sse_events(r.text)
            assert events[-1] == "[DONE]"
            usage = httpx.Response(200, content=events[-2]).json()["usage"]
        else:
            usage = r.json()["usage"]
            assert "kv_transfer_params" not in r.json()
        assert usage["completion_tokens"] == 8  # the decode pod's own max_tokens, not 1
        # the decode pod pulled the blocks the prefill pod held for it
        assert await h.pod_metric(decode_pod, "kvroute_sim_kv_transfers_total", outcome="ok") == 1
        assert await h.pod_metric(prefill_pod, "kvroute_sim_kv_leased_blocks") == 0
        # the fresh prompt had no hit on the prefill pod: that is the usage reported
        # (the decode pod counts the pulled blocks as cached)
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
        assert h.sample("kvroute_pd_decisions_total", model=MODEL, reason="split") == 1
        assert h.sample("kvroute_pd_transfers_total", model=MODEL, attempt="first") == 1
        assert h.sample("kvroute_pd_prefill_attempts_total", pod=prefill_pod, outcome="ok") == 1
        assert h.sample("kvroute_pd_prefill_seconds_count", model=MODEL, pod=prefill_pod) == 1


async def test_a_prefill_leg_s_one_token_is_a_first_token_the_router_saw() -> None:
    """The prefill pod counts the leg's token in vllm:time_to_first_token_seconds: the
    router must count it as seen, or it would read it as the first token of a JSON
    request sent to that pod as it came (router/fleet/first_tokens.py)."""
    async with pd_router(pd=SPLIT) as h:
        scraper, ledger = h.gateway.scraper, h.gateway.first_tokens
        await wait_until(lambda: all(scraper.get(p) for p in h.pods), "every pod scraped")
        streamed = chat(max_completion_tokens=8, stream=True)
        r = await h.client.post("/v1/chat/completions", json=streamed)
        assert r.status_code == 200, r.text
        prefill_pod, decode_pod = r.headers["x-kvroute-prefill-pod"], r.headers["x-kvroute-pod"]
        # the decode leg's first token was streamed back to the router: seen too
        assert (ledger.seen_count(prefill_pod), ledger.seen_count(decode_pod)) == (1, 1)


async def test_the_prefill_copy_is_capped_and_unstreamed_and_the_decode_body_keeps_its_own() -> (
    None
):
    from router.proxy.disagg import prefill_body
    from router.rewrite import rewrite_body

    body = chat(
        stream=True,
        stream_options={"include_usage": True},
        max_completion_tokens=50,
        min_tokens=5,
        min_completion_tokens=5,
    )
    raw = httpx.Request("POST", "http://x", json=body).content
    sent = httpx.Response(200, content=prefill_body(raw, body)).json()
    assert sent["stream"] is False and sent["max_tokens"] == 1
    assert sent["max_completion_tokens"] == 1
    assert not {"stream_options", "min_tokens", "min_completion_tokens"} & set(sent)
    assert sent["kv_transfer_params"]["do_remote_decode"] is True
    assert sent["messages"] == body["messages"]
    params = {"do_remote_prefill": True, "remote_block_ids": [[1, 2]], "x": {"y": None}}
    decode = httpx.Response(
        200, content=rewrite_body(raw, body, set_fields={"kv_transfer_params": params})
    ).json()
    assert decode == {**body, "kv_transfer_params": params}  # verbatim, the rest untouched


async def test_the_next_turn_prefills_where_the_prefix_is_cached() -> None:
    async with pd_router(pd=SPLIT) as h:
        first = chat()
        r1 = await h.client.post("/v1/chat/completions", json=first)
        assert r1.status_code == 200, r1.text
        p1 = r1.headers["x-kvroute-prefill-pod"]
        assert h.gateway.subscriber is not None
        await settle(list(h.pods.values()), h.gateway.subscriber)
        hits_before = await h.pod_metric(p1, "vllm:prefix_cache_hits_total")
        second = chat()
        second["messages"] += [
            {"role": "assistant", "content": r1.json()["choices"][0]["message"]["content"]},
            {"role": "user", "content": "And then?"},
        ]
        explained = await h.route(second, "turn-2")
        # each prefill candidate's view holds its own pod's blocks only
        views = {c["pod"]: c["cached_blocks"] for c in explained["candidates"]}
        other = "sim-p1" if p1 == "sim-p0" else "sim-p0"
        assert views[other] == {}
        r2 = await h.client.post("/v1/chat/completions", json=second)
        assert r2.status_code == 200, r2.text
        assert r2.headers["x-kvroute-prefill-pod"] == p1
        gained = await h.pod_metric(p1, "vllm:prefix_cache_hits_total") - hits_before
        assert gained >= 900  # the first turn's ~1,000-token prompt, measured by the pod
        assert r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == gained


async def test_by_default_short_prompts_go_straight_to_a_decode_pod_and_long_ones_split() -> None:
    async with pd_router() as h:
        r = await h.client.post("/v1/chat/completions", json=chat("Hi there"))
        assert r.status_code == 200, r.text
        assert "x-kvroute-prefill-pod" not in r.headers
        assert r.headers["x-kvroute-pod"] in ("sim-d0", "sim-d1")
        assert h.sample("kvroute_pd_decisions_total", model=MODEL, reason="short") == 1
        for pod in ("sim-p0", "sim-p1"):
            assert await h.pod_metric(pod, "vllm:request_success_total") == 0
        # a ~1,000-token prompt on this idle fleet: the hop is cheaper than a local prefill
        explained = (await h.route(chat(), "long"))["pd"]
        assert explained["reason"] == "split" and explained["prefill_pod"] in ("sim-p0", "sim-p1")
        assert explained["predicted"]["hop_cost_s"] < explained["predicted"]["local_cost_s"]
        r = await h.client.post(
            "/v1/chat/completions", json=chat(), headers={"x-request-id": "long"}
        )
        assert r.status_code == 200, r.text
        assert r.headers["x-kvroute-prefill-pod"] == explained["prefill_pod"]
        assert h.sample("kvroute_pd_decisions_total", model=MODEL, reason="split") == 1


async def test_route_explains_the_decode_pod_the_prefill_pod_and_the_split() -> None:
    async with pd_router(pd=SPLIT) as h:
        pd = (await h.route(chat(), "req-1"))["pd"]
        assert pd["split"] is True and pd["reason"] == "split"
        assert pd["decode_pod"] == pd["decode_ranking"][0]
        assert set(pd["decode_scores"]) == {"sim-d0", "sim-d1"}
        assert pd["prefill_pod"] == pd["prefill_ranking"][0]
        assert set(pd["prefill_ranking"]) == set(pd["prefill_scores"]) == {"sim-p0", "sim-p1"}
        assert "uncached_decode_tokens" in pd["predicted"]


async def test_whole_requests_without_a_prompt_to_split_go_to_pods_that_decode() -> None:
    # embeddings and passthrough requests are routed least loaded, never to a pod that
    # only prefills (it would answer a whole request nobody sized it for)
    async with pd_router() as h:
        for i in range(6):
            r = await h.client.post(
                "/v1/embeddings", json={"model": MODEL, "input": f"text number {i}"}
            )
            assert r.status_code == 200, r.text
            assert r.headers["x-kvroute-pod"] in ("sim-d0", "sim-d1")


# -- failures ---------------------------------------------------------------------------


async def test_a_prefill_pod_that_cannot_be_reached_is_replaced_by_the_next_one() -> None:
    async with pd_router(prefill=1, extra=[dead("dead-p", "prefill")], pd=SPLIT) as h:
        rid = await h.rid_where(chat(), prefill_pod="dead-p")
        r = await h.client.post("/v1/chat/completions", json=chat(), headers={"x-request-id": rid})
        assert r.status_code == 200, r.text
        assert r.headers["x-kvroute-prefill-pod"] == "sim-p0"
        assert h.sample("kvroute_pd_prefill_attempts_total", pod="dead-p", outcome="failed") == 1
        assert h.sample("kvroute_upstream_errors_total", pod="dead-p", reason="connect") == 1


async def test_no_prefill_pod_answering_sends_the_plain_request_to_the_decode_pod() -> None:
    extra = [dead("dead-p0", "prefill"), dead("dead-p1", "prefill")]
    async with pd_router(prefill=0, extra=extra, pd=SPLIT) as h:
        r = await h.client.post("/v1/chat/completions", json=chat())
        assert r.status_code == 200, r.text
        assert "x-kvroute-prefill-pod" not in r.headers
        assert h.sample("kvroute_pd_fallbacks_total", model=MODEL, reason="prefill_failed") == 1
        pod = r.headers["x-kvroute-pod"]
        assert await h.pod_metric(pod, "kvroute_sim_kv_transfers_total") == 0


async def test_a_prefill_answer_without_params_sends_the_original_request_to_the_decode_pod() -> (
    None
):
    # a pod the router believes is a prefill pod, that does not hold blocks (a decode pod)
    async with pd_router(prefill=0, decode=3, roles={"sim-d2": "prefill"}, pd=SPLIT) as h:
        r = await h.client.post("/v1/chat/completions", json=chat(stream=True))
        assert r.status_code == 200, r.text
        assert sse_events(r.text)[-1] == "[DONE]"
        assert "x-kvroute-prefill-pod" not in r.headers
        assert h.sample("kvroute_pd_fallbacks_total", model=MODEL, reason="no_params") == 1
        assert h.sample("kvroute_pd_prefill_attempts_total", pod="sim-d2", outcome="no_params") == 1


async def test_an_unreachable_decode_pod_is_replaced_by_another_with_the_same_params() -> None:
    async with pd_router(decode=1, extra=[dead("dead-d", "decode")], pd=SPLIT) as h:
        rid = await h.rid_where(chat(), decode_pod="dead-d")
        r = await h.client.post("/v1/chat/completions", json=chat(), headers={"x-request-id": rid})
        assert r.status_code == 200, r.text
        assert r.headers["x-kvroute-pod"] == "sim-d0"
        assert "x-kvroute-prefill-pod" in r.headers
        assert h.sample("kvroute_pd_transfers_total", model=MODEL, attempt="retry") == 1
        assert await h.pod_metric("sim-d0", "kvroute_sim_kv_transfers_total", outcome="ok") == 1


async def test_past_the_lease_an_unreachable_decode_pod_is_replaced_by_a_plain_request() -> None:
    pd = {**SPLIT, "kv_lease_s": 1e-6}
    async with pd_router(decode=1, extra=[dead("dead-d", "decode")], pd=pd) as h:
        rid = await h.rid_where(chat(), decode_pod="dead-d")
        r = await h.client.post("/v1/chat/completions", json=chat(), headers={"x-request-id": rid})
        assert r.status_code == 200, r.text
        assert r.headers["x-kvroute-pod"] == "sim-d0"
        assert h.sample("kvroute_pd_fallbacks_total", model=MODEL, reason="decode_retry") == 1
        assert await h.pod_metric("sim-d0", "kvroute_sim_kv_transfers_total") == 0


async def test_a_decode_pod_whose_pull_fails_is_replaced_by_a_plain_request() -> None:
    # sim-d0 may not dial the prefill pods: its pull fails, vLLM's default policy answers 500
    sim = {"sim-d0": {"kv_peer_hosts": ["pods.invalid"]}}
    async with pd_router(sim=sim, pd=SPLIT) as h:
        rid = await h.rid_where(chat(), decode_pod="sim-d0")
        r = await h.client.post("/v1/chat/completions", json=chat(), headers={"x-request-id": rid})
        assert r.status_code == 200, r.text
        assert r.headers["x-kvroute-pod"] == "sim-d1"
        assert await h.pod_metric("sim-d0", "kvroute_sim_kv_transfers_total", outcome="failed") == 1
        assert await h.pod_metric("sim-d1", "kvroute_sim_kv_transfers_total") == 0
        assert h.sample("kvroute_pd_fallbacks_total", model=MODEL, reason="decode_retry") == 1
        assert h.sample("kvroute_upstream_errors_total", pod="sim-d0", reason="status_500") == 1


async def test_a_client_leaving_during_the_prefill_aborts_it_and_strands_no_blocks() -> None:
    # 20 tokens/s: the ~1,000-token prefill takes 50 s unless aborted
    sim = {"sim-p0": {"prefill_rate": 20.0}}
    async with pd_router(prefill=1, sim=sim, pd=SPLIT) as h:
        with pytest.raises(httpx.ReadTimeout):
            await h.client.post("/v1/chat/completions", json=chat(), timeout=1.0)

        async def aborted() -> bool:
            s = h.sample(
                "kvroute_pd_prefill_attempts_total", pod="sim-p0", outcome="client_disconnected"
            )
            return s == 1

        await wait_until(aborted, "the prefill to be cancelled", timeout=10)
        assert await h.pod_metric("sim-p0", "kvroute_sim_kv_leased_blocks") == 0
        assert h.sample("kvroute_pd_transfers_total", model=MODEL, attempt="first") == 0
