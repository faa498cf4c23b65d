"""TLS to pods and to the Kubernetes API server, with real certificates over loopback.

A test CA (``trustme``) signs a server certificate for 127.0.0.1 / localhost; a second,
unrelated CA stands for "the wrong CA".  Simulated pods and the fake Kubernetes API
server are served over https by uvicorn on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import trustme
import uvloop
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from router.config import Settings
from router.fleet.k8s import K8sDiscovery
from router.fleet.pod_connection import PAUSE_ABOVE
from router.fleet.pods import PodRegistry
from router.fleet.tls import PodTLS
from router.fleet.transport import PodTransport
from router.proxy.gateway import Gateway
from router.sim.pod import SimPod
from router.sim.settings import SimSettings
from tests.router.discovery_support import FakeApiServer, k8s_pod, k8s_settings
from tests.support.aio import running, serve_app, wait_until
from tests.support.one_pod import one_pod_router

MODEL = "sim-model"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello over tls"}]}


@dataclass
class Certs:
    ca: Path  # the CA that signed the pods' certificate (PEM)
    other_ca: Path  # an unrelated CA
    server: Path  # key + certificate chain for 127.0.0.1 and localhost
    wrong_name: Path  # signed by ``ca``, but for another host name


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    d = tmp_path_factory.mktemp("tls")
    ca, other = trustme.CA(), trustme.CA()
    c = Certs(d / "ca.pem", d / "other-ca.pem", d / "server.pem", d / "wrong-name.pem")
    ca.cert_pem.write_to_path(str(c.ca))
    other.cert_pem.write_to_path(str(c.other_ca))
    ca.issue_cert("127.0.0.1", "localhost").private_key_and_cert_chain_pem.write_to_path(
        str(c.server)
    )
    ca.issue_cert("pod.example").private_key_and_cert_chain_pem.write_to_path(str(c.wrong_name))
    return c


def serve_tls(app: Any, certfile: Path) -> contextlib.AbstractAsyncContextManager[str]:
    """Serve ``app`` over https on a free 127.0.0.1 port; yield its base URL."""
    return serve_app(app, str(certfile))


@contextlib.asynccontextmanager
async def https_sim_pod(certfile: Path) -> AsyncIterator[str]:
    """A simulated vLLM pod's API served over https; yields its URL."""
    pod = SimPod(
        SimSettings.model_validate(
            {"pod_name": "tls-0", "time_scale": 0, "kv_events": False, "max_model_len": 4096}
        )
    )
    async with serve_tls(pod.app, certfile) as url:
        yield url


def router_for(
    pod_url: str, **proxy: Any
) -> contextlib.AbstractAsyncContextManager[tuple[Gateway, httpx.AsyncClient]]:
    """The router (uvicorn, plain http on loopback) in front of the one pod at ``pod_url``."""
    return one_pod_router("a", pod_url, MODEL, proxy=proxy)


# -- pods over https ---------------------------------------------------------------------


async def test_https_pod_answers_non_streaming_and_streaming_through_the_router(
    certs: Certs,
) -> None:
    async with (
        https_sim_pod(certs.server) as pod_url,
        router_for(pod_url, pod_ca_file=str(certs.ca)) as (_, client),
    ):
        r = await client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200, r.text
        assert r.headers["x-kvroute-pod"] == "a"
        assert r.json()["choices"][0]["message"]["content"]

        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "tls"})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"]

        lines: list[str] = []
        async with client.stream(
            "POST", "/v1/chat/completions", json={**CHAT, "stream": True}
        ) as s:
            assert s.status_code == 200
            assert s.headers["content-type"].startswith("text/event-stream")
            async for line in s.aiter_lines():
                if line:
                    lines.append(line)
        assert len(lines) > 2 and lines[-1] == "data: [DONE]"
        # the keep-alive TLS connection went back to the pool and is reused
        r = await client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200
        metrics = (await client.get("/metrics")).text
        assert "kvroute_upstream_errors_total{" not in metrics


@pytest.mark.parametrize("trusted", [True, False])
async def test_a_remote_tokenizer_on_an_https_pod_uses_the_pods_ca(
    certs: Certs, trusted: bool
) -> None:
    """``tokenizer: remote:https://...`` asks the pod's /tokenize with the same TLS
    context as requests to pods (``proxy.pod_ca_file``)."""
    async with https_sim_pod(certs.server) as pod_url:
        ca = certs.ca if trusted else certs.other_ca
        async with one_pod_router(
            "a",
            pod_url,
            MODEL,
            tokenizer=f"remote:{pod_url}",
            proxy={"pod_ca_file": str(ca)},
        ) as (_, client):
            r = await client.post("/v1/route", json=CHAT)
            if trusted:
                assert r.status_code == 200, r.text
                assert r.json()["tokenizer"].startswith("remote:https://127.0.0.1:")
                assert r.json()["prompt_tokens"] > 0
                r = await client.post("/v1/chat/completions", json=CHAT)
                assert r.status_code == 200, r.text
            else:  # the handshake fails: the request cannot be tokenized, said so
                assert r.status_code >= 400
                assert "tokenize" in r.json()["error"]["message"]


async def test_health_checks_and_metrics_scrapes_reach_an_https_pod(certs: Certs) -> None:
    async with (
        https_sim_pod(certs.server) as pod_url,
        router_for(pod_url, pod_ca_file=str(certs.ca)) as (gateway, _),
    ):
        state = gateway.registry.get("a")
        assert state is not None
        assert await gateway.health.check(state)
        assert "a" not in gateway.health.last_problem
        assert MODEL in state.models  # learned from the pod's /v1/models over https

        await gateway.scraper.scrape_all()
        scraped = gateway.scraper.get("a")
        assert scraped is not None  # /metrics parsed
        assert gateway.scraper.max_model_len["a"][MODEL] == 4096  # and /v1/models
        # one TLS context for requests, scrapes and health checks
        assert gateway.transport.tls is gateway.pod_tls


@pytest.mark.parametrize("trust", ["other_ca", "system_store"])
async def test_a_pod_certificate_from_an_untrusted_ca_is_a_502_naming_tls_in_the_log(
    certs: Certs, trust: str, caplog: pytest.LogCaptureFixture
) -> None:
    proxy = {"pod_ca_file": str(certs.other_ca)} if trust == "other_ca" else {}
    async with (
        https_sim_pod(certs.server) as pod_url,
        router_for(pod_url, **proxy) as (
            gateway,
            client,
        ),
    ):
        with caplog.at_level(logging.WARNING, logger="router.proxy.forward"):
            r = await client.post("/v1/chat/completions", json=CHAT)
            r2 = await client.post("/v1/chat/completions", json=CHAT)
        for resp in (r, r2):
            assert resp.status_code == 502, resp.text
            err = resp.json()["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["type"] == "upstream_error" and err["code"] == "connect"
            assert "CERTIFICATE_VERIFY_FAILED" in err["message"]
        tls_lines = [m for m in caplog.messages if "TLS handshake with pod" in m]
        assert len(tls_lines) == 1  # logged once, not once per request
        assert "certificate verify failed" in tls_lines[0]
        metrics = (await client.get("/metrics")).text
        assert 'kvroute_upstream_errors_total{pod="a",reason="connect"} 2.0' in metrics

        # health checks and scrapes fail the same way, and say why
        state = gateway.registry.get("a")
        assert state is not None
        assert not await gateway.health.check(state)
        assert "CERTIFICATE_VERIFY_FAILED" in gateway.health.last_problem["a"]
        await gateway.scraper.scrape_all()
        assert gateway.scraper.get("a") is None
        errors = [
            ln
            for ln in (await client.get("/metrics")).text.splitlines()
            if ln.startswith('kvroute_scrape_errors_total{pod="a"}')
        ]
        assert errors and float(errors[0].split()[1]) >= 1  # (the background scraper too)


async def test_a_pod_certificate_for_another_host_name_is_refused(certs: Certs) -> None:
    async with (
        https_sim_pod(certs.wrong_name) as pod_url,
        router_for(pod_url, pod_ca_file=str(certs.ca)) as (_, client),
    ):
        r = await client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 502
        assert "IP address mismatch" in r.json()["error"]["message"]


async def test_pod_tls_verify_off_accepts_any_certificate(certs: Certs) -> None:
    async with (
        https_sim_pod(certs.wrong_name) as pod_url,
        router_for(pod_url, pod_tls_verify=False) as (gateway, client),
    ):
        r = await client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200, r.text
        state = gateway.registry.get("a")
        assert state is not None and await gateway.health.check(state)


def test_pod_ca_file_must_exist(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="no such CA file"):
        Settings.model_validate({"proxy": {"pod_ca_file": str(tmp_path / "nope.pem")}})


def test_the_tls_context_is_built_once_and_only_when_asked() -> None:
    tls = PodTLS()
    assert tls._context is None  # a plain-http fleet never loads a trust store
    ctx = tls.context()
    assert tls.context() is ctx
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    insecure = PodTLS(verify=False).context()
    assert insecure.verify_mode == ssl.CERT_NONE and not insecure.check_hostname


def _big_pod() -> Starlette:
    """A pod whose answers exercise the transport: /health, a body 3x the pause
    threshold (reading pauses and resumes on the TLS transport), a chunked stream."""
    big = bytes(range(256)) * ((3 * PAUSE_ABOVE) // 256)

    async def health(request: Request) -> Response:
        return Response(b"")

    async def whole(request: Request) -> Response:
        return Response(big)

    async def stream(request: Request) -> Response:
        async def parts() -> AsyncIterator[bytes]:
            for i in range(5):
                yield b"data: %d\n\n" % i

        return StreamingResponse(parts(), media_type="text/event-stream")

    return Starlette(
        routes=[Route("/health", health), Route("/big", whole), Route("/stream", stream)]
    )


def _get(path: bytes) -> bytes:
    return b"GET " + path + b" HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: 0\r\n\r\n"


def test_the_transport_speaks_tls_on_uvloop(certs: Certs) -> None:
    """The router's production loop: keep-alive reuse, a body larger than the pause
    threshold, a stream, httpx requests through the transport, a refused CA."""

    async def scenario() -> None:
        async with serve_tls(_big_pod(), certs.server) as url:
            port = int(url.rsplit(":", 1)[1])
            good = PodTransport(tls=PodTLS(str(certs.ca)))
            try:
                for _ in range(2):
                    up = await good.send_raw("127.0.0.1", port, _get(b"/health"), b"", 5, 5, True)
                    assert up.status == 200
                    await up.stream.read_all()
                    await up.stream.aclose()
                origin = good._origins[("127.0.0.1", port, True)]
                assert len(origin.idle) == 1  # one connection, reused

                up = await good.send_raw("127.0.0.1", port, _get(b"/big"), b"", 5, 30, True)
                body = await up.stream.read_all()
                await up.stream.aclose()
                assert len(body) == 3 * PAUSE_ABOVE // 256 * 256
                assert body[:512] == bytes(range(256)) * 2

                up = await good.send_raw("127.0.0.1", port, _get(b"/stream"), b"", 5, 5, True)
                assert up.is_event_stream
                streamed = b"".join([c async for c in up.stream])
                assert streamed == b"".join(b"data: %d\n\n" % i for i in range(5))

                async with httpx.AsyncClient(transport=good) as client:
                    r = await client.get(url + "/health")
                    assert r.status_code == 200
            finally:
                await good.aclose()
            bad = PodTransport(tls=PodTLS(str(certs.other_ca)))
            try:
                with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
                    await bad.send_raw("127.0.0.1", port, _get(b"/health"), b"", 5, 5, True)
            finally:
                await bad.aclose()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(scenario())


# -- the Kubernetes API server over https -------------------------------------------------


@contextlib.asynccontextmanager
async def k8s_over_tls(
    certs: Certs, tmp_path: Path, ca_file: Path
) -> AsyncIterator[tuple[FakeApiServer, K8sDiscovery, PodRegistry]]:
    api = FakeApiServer()
    api.items = [k8s_pod("a", ip="10.0.0.1")]
    async with serve_tls(api.app, certs.server) as url:
        disc = K8sDiscovery(k8s_settings(url, tmp_path, ca_file=str(ca_file), scheme="https"))
        reg = PodRegistry()
        async with running(disc.run(reg)) as task:
            yield api, disc, reg
            assert not task.done()  # discovery is still running


async def test_k8s_discovery_lists_and_watches_an_https_api_server_with_its_ca(
    certs: Certs, tmp_path: Path
) -> None:
    async with k8s_over_tls(certs, tmp_path, certs.ca) as (api, disc, reg):
        await wait_until(lambda: len(api.watches()) == 1)
        assert [p.name for p in reg.all()] == ["a"]
        assert reg.get("a").spec.url == "https://10.0.0.1:8000"  # type: ignore[union-attr]
        assert api.lists()[0]["auth"] == "Bearer s3cret-token"
        await api.watch_queue.put({"type": "ADDED", "object": k8s_pod("b", "10.0.0.2")})
        await wait_until(lambda: reg.get("b") is not None)
        assert disc.errors == 0


async def test_k8s_discovery_with_the_wrong_ca_counts_logs_and_retries(
    certs: Certs, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="router.fleet.discovery"):
        async with k8s_over_tls(certs, tmp_path, certs.other_ca) as (api, disc, reg):
            await wait_until(lambda: disc.errors >= 2)  # failed, paused, tried again
            assert api.requests == []  # no request got past the handshake
            assert reg.all() == []
    logged = [m for m in caplog.messages if "k8s discovery: ConnectError" in m]
    assert logged and "CERTIFICATE_VERIFY_FAILED" in logged[0], caplog.messages


def test_k8s_discovery_says_when_its_ca_file_is_missing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An https API server with no service-account CA on disk (outside a pod) is
    verified against the system trust store: said once, when the client is made."""
    missing = tmp_path / "no-such-ca.crt"
    disc = K8sDiscovery(k8s_settings("https://127.0.0.1:1", tmp_path, ca_file=str(missing)))
    with caplog.at_level(logging.WARNING, logger="router.fleet.discovery"):
        client = disc._make_client()
    asyncio.run(client.aclose())
    warned = [r.getMessage() for r in caplog.records if "ca_file" in r.getMessage()]
    assert len(warned) == 1 and str(missing) in warned[0]
