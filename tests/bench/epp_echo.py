"""Do-nothing ext_proc pickers for ``bench_epp.py --floor``: round robin over the pods,
every body sent back as it came, on the same gRPC servers and message code as kvroute's
(what the ext_proc exchange alone costs in Python)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench_router_overhead import Proc, free_port

ROOT = Path(__file__).resolve().parents[2]


#: the servers ``--floor`` can run (aio: grpc.aio, as `kvroute epp` by default)
MODES = ("aio", "uvloop", "sync", "grpclib", "grpclib-uvloop", "h2", "h2-asyncio", "cpp")
#: with this variable set to a file, each stream's messages are written to it as one
#: JSON line at the stream's end: ``[[microseconds since its first message, "in" or
#: "out", kind], ...]`` (``--trace``)
TRACE_ENV = "KVROUTE_BENCH_EPP_TRACE"
EXT_PROC = "envoy.service.ext_proc.v3.ExternalProcessor"


class EchoStream:
    """One stream of the do-nothing picker: the pick (round robin) and the body back at
    the body's end, every other message answered as it came."""

    def __init__(self, turn: Iterator[str], trace: list[Any] | None) -> None:
        self.turn = turn
        self.size = 0
        self.held: list[bytes] = []  # the body, until its end: the pick answers first
        self.trace = trace
        self.t0 = 0

    def handle(self, req: Any) -> list[Any]:
        from router.epp import protocol as P

        which = req.WhichOneof("request")
        out: list[Any] = []
        if which == "request_body":
            b = req.request_body
            self.size += len(b.body)
            self.held.append(b.body)
            if b.end_of_stream:
                out = [P.pick_headers_response(next(self.turn), self.size)]
                for i, chunk in enumerate(self.held):
                    out += P.body_responses(True, chunk, i == len(self.held) - 1)
        elif which == "response_headers":
            out = [P.headers_response(False)]
        elif which == "response_body":
            b = req.response_body
            out = list(P.body_responses(False, b.body, b.end_of_stream))
        elif which in ("request_trailers", "response_trailers"):
            out = [P.trailers_response(which == "request_trailers")]
        if self.trace is not None:
            now = time.perf_counter_ns() // 1000
            if not self.trace:
                self.t0 = now
            self.trace.append((now - self.t0, "in", which))
            for r in out:
                self.trace.append((now - self.t0, "out", r.WhichOneof("response")))
        return out

    def done(self) -> None:
        if self.trace:
            with open(os.environ[TRACE_ENV], "a") as f:
                f.write(json.dumps(self.trace) + "\n")


def serve_echo(port: int, endpoints: list[str], mode: str = "aio") -> None:
    """A picker that decides nothing (``--floor``) on the server ``mode``."""
    import itertools

    turn = itertools.cycle(endpoints)
    tracing = bool(os.environ.get(TRACE_ENV))

    def stream() -> EchoStream:
        return EchoStream(turn, [] if tracing else None)

    if mode == "sync":
        _run_sync(port, stream)
    elif mode.startswith("h2"):
        if mode == "h2":
            _install_loop("uvloop")
        asyncio.run(_run_h2(port, stream))
    elif mode.startswith("grpclib"):
        _install_loop(mode)
        asyncio.run(_run_grpclib(port, stream))
    else:
        _install_loop(mode)
        asyncio.run(_run_aio(port, stream))


def _install_loop(mode: str) -> None:
    if mode.endswith("uvloop"):
        import uvloop

        uvloop.install()


def _ready(port: int) -> None:
    print("echo ext_proc on", port, flush=True)


async def _run_aio(port: int, stream: Callable[[], EchoStream]) -> None:
    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_health.v1.health import aio as health_aio

    class Echo(ep_grpc.ExternalProcessorServicer):
        async def Process(self, request_iterator: Any, context: Any) -> None:
            s = stream()
            try:
                while True:
                    req = await context.read()
                    if req is grpc.aio.EOF:
                        return
                    for r in s.handle(req):
                        await context.write(r)
            finally:
                s.done()

    server = grpc.aio.server()
    ep_grpc.add_ExternalProcessorServicer_to_server(Echo(), server)
    health = health_aio.HealthServicer()  # Envoy health-checks its ext_proc service
    await health.set(EXT_PROC, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    _ready(port)
    await server.wait_for_termination()


def _run_sync(port: int, stream: Callable[[], EchoStream]) -> None:
    """The same on grpc's synchronous server (a thread per stream)."""
    from concurrent import futures

    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    class SyncEcho(ep_grpc.ExternalProcessorServicer):
        def Process(self, request_iterator: Any, context: Any) -> Any:
            s = stream()
            try:
                for req in request_iterator:
                    yield from s.handle(req)
            finally:
                s.done()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
    ep_grpc.add_ExternalProcessorServicer_to_server(SyncEcho(), server)
    checker = health.HealthServicer()
    checker.set(EXT_PROC, health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    _ready(port)
    server.wait_for_termination()


async def _run_h2(port: int, stream: Callable[[], EchoStream]) -> None:
    """The same on kvroute's own server (router/epp/h2_grpc.py; h2: on uvloop)."""
    from grpc_health.v1 import health_pb2

    from router.epp import h2_grpc
    from router.epp import protocol as P

    async def process(call: h2_grpc.Call) -> None:
        e = stream()
        try:
            while (req := await call.read()) is not None:
                for r in e.handle(req):
                    call.write(r)
        finally:
            e.done()

    async def check(call: h2_grpc.Call) -> None:
        await call.read()
        call.write(health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING))

    server = h2_grpc.H2GrpcServer(
        {
            f"/{EXT_PROC}/Process": h2_grpc.Method(process, P.ProcessingRequest),
            "/grpc.health.v1.Health/Check": h2_grpc.Method(check, health_pb2.HealthCheckRequest),
        }
    )
    await server.start("127.0.0.1", port)
    _ready(port)
    await asyncio.Event().wait()


async def _run_grpclib(port: int, stream: Callable[[], EchoStream]) -> None:
    """The same on grpclib (HTTP/2 in Python on the event loop)."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
    from grpc_health.v1 import health_pb2
    from grpclib.const import Cardinality, Handler
    from grpclib.server import Server

    class Echo:
        async def process(self, s: Any) -> None:
            e = stream()
            try:
                while (req := await s.recv_message()) is not None:
                    for r in e.handle(req):
                        await s.send_message(r)
            finally:
                e.done()

        async def check(self, s: Any) -> None:
            await s.recv_message()
            await s.send_message(health_pb2.HealthCheckResponse(status=1))

        def __mapping__(self) -> dict[str, Any]:
            return {
                f"/{EXT_PROC}/Process": Handler(
                    self.process,
                    Cardinality.STREAM_STREAM,
                    ep.ProcessingRequest,
                    ep.ProcessingResponse,
                ),
                "/grpc.health.v1.Health/Check": Handler(
                    self.check,
                    Cardinality.UNARY_UNARY,
                    health_pb2.HealthCheckRequest,
                    health_pb2.HealthCheckResponse,
                ),
            }

    server = Server([Echo()])
    await server.start("127.0.0.1", port)
    _ready(port)
    await server.wait_closed()


def start_echo(urls: list[str], mode: str = "aio", trace: Path | None = None) -> tuple[Proc, int]:
    port = free_port()
    endpoints = ",".join(u.split("//", 1)[1] for u in urls)
    if mode == "cpp":  # the same picker in C++ (epp_floor/echo_picker.cc), built once
        sys.path.insert(0, str(Path(__file__).parent / "epp_floor"))
        from build import build

        binary = Path("/tmp/kvroute-epp-floor/echo_picker")
        command = [str(binary if binary.exists() else build(binary.parent)), str(port), endpoints]
    else:
        command = [sys.executable, __file__, str(port), endpoints, mode]
    p = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT), **({TRACE_ENV: str(trace)} if trace else {})},
    )
    assert p.stdout is not None
    p.stdout.readline()
    return Proc(f"echo-{mode}", p), port


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    serve_echo(int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3])
