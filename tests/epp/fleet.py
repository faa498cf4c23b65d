"""Simulated pods and a running EPP for the tests (everything on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import httpx

from router.config import Settings
from router.epp.picker import EndpointPicker
from router.epp.server import EppServer
from router.fleet.embedded import start_pods, static_pods, stop_pods
from router.sim.pod import SimPod
from router.sim.settings import SimSettings
from tests.epp.envoy_proxy import Envoy, envoy_binary, envoy_config

MODEL = "sim-model"
#: the gRPC server of the EPPs :func:`running_epp` starts (the ``grpc_server`` fixture
#: of tests/epp/conftest.py runs a test on each)
GRPC_SERVER = "h2"


def sim(i: int, **kw: Any) -> SimSettings:
    base: dict[str, Any] = {
        "pod_name": f"sim-{i}",
        "model": MODEL,
        "block_size": 16,
        "capacity_tokens": 12288,
        "time_scale": 0.05,
        "max_model_len": 1 << 20,  # 200 KB prompts (the builtin tokenizer: 1 token a byte)
    }
    base.update(kw)
    return SimSettings.model_validate(base)


@contextlib.asynccontextmanager
async def sim_pods(n: int, **kw: Any) -> AsyncIterator[list[SimPod]]:
    pods = await start_pods([sim(i, **kw) for i in range(n)])
    try:
        yield pods
    finally:
        await stop_pods(pods)


def settings_for(pods: Sequence[SimPod], **kw: Any) -> Settings:
    static = [p.model_dump() for p in static_pods(pods)]
    return Settings.model_validate(
        {"discovery": {"static": static}, "fleet": {"enabled": False}, **kw}
    )


def host_port(url: str) -> tuple[str, int]:
    hostport = url.split("//", 1)[1].rstrip("/")
    host, port = hostport.rsplit(":", 1)
    return host, int(port)


def endpoint(pod: SimPod) -> str:
    return "{}:{}".format(*host_port(pod.url))


@contextlib.asynccontextmanager
async def running_epp(
    settings: Settings, *, endpoints: int = 1
) -> AsyncIterator[tuple[EppServer, grpc.aio.Channel]]:
    """An EPP on free loopback ports and a gRPC channel to it."""
    server = EppServer(
        EndpointPicker(settings, endpoints=endpoints),
        grpc_port=0,
        metrics_port=0,
        grpc_server=GRPC_SERVER,
    )
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.grpc_address) as channel:
            yield server, channel
    finally:
        await server.stop(grace_s=1.0)


@contextlib.asynccontextmanager
async def envoy(
    pods: Sequence[Any], epp: tuple[str, int] | None, **kw: Any
) -> AsyncIterator[Envoy]:
    """Envoy in front of ``pods``, started off the loop (its start waits for its first
    health check of the EPP, which this loop answers)."""
    binary = envoy_binary()
    assert binary is not None
    proc = Envoy(envoy_config([host_port(p.url) for p in pods], epp, **kw), binary)
    try:
        yield await asyncio.to_thread(proc.start)
    finally:
        await asyncio.to_thread(proc.stop)


@contextlib.asynccontextmanager
async def epp_envoy(
    pods: Sequence[Any], settings: Settings, **kw: Any
) -> AsyncIterator[tuple[EppServer, httpx.AsyncClient, Envoy]]:
    endpoints = kw.pop("endpoints", 1)
    async with running_epp(settings, endpoints=endpoints) as (server, _):
        address = ("127.0.0.1", server.grpc_port)
        async with (
            envoy(pods, address, **kw) as proxy,
            httpx.AsyncClient(base_url=proxy.url, timeout=30) as client,
        ):
            yield server, client, proxy
