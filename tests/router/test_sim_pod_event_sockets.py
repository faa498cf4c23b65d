"""The simulated vLLM pod's event sockets: connect mode, wildcard endpoints, and a failed
start that closes them (real ZMQ and HTTP on 127.0.0.1).
"""

from __future__ import annotations

import socket
from collections.abc import Awaitable, Callable

import httpx
import pytest
import zmq
import zmq.asyncio

from router.sim import SimPod, SimSettings
from tests.router.sim_pod_support import MakePod, Sub
from tests.router.sim_pod_support import http as http  # the fixture
from tests.router.sim_pod_support import make_pod as make_pod  # the fixture
from tests.router.sim_pod_support import subscribe as subscribe  # the fixture


async def test_connect_mode_pub_dials_a_subscriber_bound_socket(
    make_pod: MakePod, http: httpx.AsyncClient
) -> None:
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        pods = [
            await make_pod(pod_name=f"c{i}", kv_endpoint=f"tcp://127.0.0.1:{port}")
            for i in range(2)
        ]
        sub = Sub(sock)
        for pod in pods:
            assert pod.events_endpoint is None  # nothing to dial: the pod connected out
            await sub.sync(pod)
        await http.post(f"{pods[1].url}/v1/completions", json={"prompt": "k" * 40})
        topic, _, batch = await sub.recv()
        assert topic == b"kv@c1@sim-model"
        assert batch[1][0]["type"] == "BlockStored"
    finally:
        sock.close(linger=0)


async def test_a_wildcard_endpoint_binds_and_reports_a_loopback_address_to_dial(
    make_pod: MakePod, http: httpx.AsyncClient, subscribe: Callable[[SimPod], Awaitable[Sub]]
) -> None:
    pod = await make_pod(kv_endpoint="tcp://*:0", replay_endpoint="tcp://*:0")
    assert pod.events_endpoint is not None and pod.replay_endpoint_url is not None
    assert pod.events_endpoint.startswith("tcp://127.0.0.1:")
    assert pod.replay_endpoint_url.startswith("tcp://127.0.0.1:")
    sub = await subscribe(pod)
    await http.post(f"{pod.url}/v1/completions", json={"prompt": "u" * 40, "max_tokens": 1})
    assert (await sub.events())[0]["type"] == "BlockStored"


async def test_a_taken_http_port_fails_start_and_closes_the_event_sockets(
    make_pod: MakePod,
) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        pod = SimPod(SimSettings(port=taken.getsockname()[1], time_scale=0))
        with pytest.raises(OSError):
            await pod.start()
        assert pod.publisher is not None and pod.publisher._pub is None
        # the event port is free again: a second pod can take the same endpoint
        assert pod.publisher.endpoint is not None
        port = pod.publisher.endpoint.rsplit(":", 1)[1]
        again = await make_pod(kv_endpoint=f"tcp://*:{port}")  # '*': bind, as vLLM does
        assert again.events_endpoint == pod.publisher.endpoint
    finally:
        taken.close()
