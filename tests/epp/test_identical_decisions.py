"""The EPP decides exactly as `kvroute serve` does: the same body, the same state, the
same ranking.

Four simulated pods publish real KV events to two routers at once: the proxy front
(`kvroute serve`'s app on loopback) and the EPP (on gRPC).  The pods' caches are warmed
by requests sent to them directly, so both indexes hold the same blocks; scraping is
frozen after its first round (both see the idle fleet) so that nothing but the index
and the body decides.  Then every body is decided by both: the proxy's ``POST
/v1/route`` (its whole ranking) and an ext_proc stream asking for every pod, best
first; each EPP stream is completed at once, as if the pod had answered, so the
policy's bookkeeping returns to where it was.  The cost policy's hot set (the blocks it
routed to each pod recently, which outlive the request) is turned off: ``/v1/route`` is
a dry run that routes nothing, while the EPP's streams are routed, so that history
would differ by construction.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from router.proxy.app import create_app
from router.proxy.gateway import Gateway
from router.proxy.serve import RunningServer
from router.sim.pod import SimPod
from tests.epp import client as C
from tests.epp.fleet import MODEL, endpoint, running_epp, settings_for, sim_pods
from tests.support.aio import wait_until

SYSTEMS = ["You answer billing questions.", "You review code.", "You plan cheap trips."]


async def settled(core: Any, pods: list[SimPod]) -> None:
    def received() -> bool:
        return all(
            p.publisher is not None
            and core.subscriber.stats.pods[p.name].last_seq >= p.publisher.next_seq - 1
            for p in pods
        )

    await wait_until(received, "the pods' KV events to reach the router", timeout=60)
    await core.subscriber.drain()


def conversation(c: int, turns: int) -> list[dict[str, str]]:
    history = [{"role": "system", "content": SYSTEMS[c % len(SYSTEMS)] * 20}]
    for t in range(turns):
        history.append({"role": "user", "content": f"conversation {c} question {t} " * 30})
        history.append({"role": "assistant", "content": f"answer {c}.{t} " * 10})
    return history


def bodies() -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    for c in range(8):  # warmed conversations, one turn further; and new ones
        messages = [*conversation(c, 1), {"role": "user", "content": f"and then {c}?"}]
        out.append(("/v1/chat/completions", {"model": MODEL, "messages": messages}))
    for c in range(8, 12):
        out.append(("/v1/chat/completions", {"model": MODEL, "messages": conversation(c, 1)}))
    out.append(("/v1/completions", {"model": MODEL, "prompt": "conversation 1 question 0 " * 30}))
    out.append(("/v1/completions", {"model": MODEL, "prompt": "a prompt nobody has seen " * 9}))
    return out


async def test_the_epp_ranks_every_body_as_kvroute_serve_does() -> None:
    async with sim_pods(4) as pods:
        frozen = {"scrape": {"interval_s": 3600.0}, "policy_params": {"hot_window_s": 0.0}}
        app = create_app(settings_for(pods, **frozen))
        async with (
            RunningServer(app) as proxy,
            httpx.AsyncClient(base_url=proxy.url, timeout=30) as http,
            running_epp(settings_for(pods, **frozen), endpoints=len(pods)) as (epp, channel),
        ):
            gateway: Gateway = app.state.gateway
            for c in range(8):  # warm: conversation c's first turn on pod c % 4
                body = {"model": MODEL, "messages": conversation(c, 1)[:2], "max_tokens": 4}
                r = await http.post(pods[c % 4].url + "/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
            for core in (gateway, epp.picker):
                await settled(core, pods)
            pod_of = {endpoint(p): p.name for p in pods}
            proxy_rankings, epp_rankings = [], []
            for i, (path, body) in enumerate(bodies()):
                headers = {"x-request-id": f"req-{i}"}
                r = await http.post("/v1/route", json=body, headers=headers)
                assert r.status_code == 200, r.text
                proxy_rankings.append([c["pod"] for c in r.json()["candidates"]])
                stream = C.Stream(channel)
                await stream.send(
                    C.request_headers(path, extra=list(headers.items())),
                    C.request_body(json.dumps(body).encode(), True),
                )
                answer, _ = await stream.read_request_pick()
                epp_rankings.append([pod_of[e] for e in C.destination_metadata(answer).split(",")])
                await stream.send(C.response_headers(), C.response_body(b"{}", True))
                await stream.read(2)
                await stream.close()
    assert epp_rankings == proxy_rankings
    assert len({r[0] for r in proxy_rankings}) >= 3  # the bodies do go to different pods
