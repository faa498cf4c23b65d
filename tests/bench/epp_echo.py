"""Do-nothing ext_proc pickers for ``bench_epp.py --floor``: round robin over the pods,
every body sent back as it came, on the same gRPC servers and message code as kvroute's
(what the ext_proc exchange alone costs in Python)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench_router_overhead import Proc, free_port

ROOT = Path(__file__).resolve().parents[2]


def serve_echo(port: int, endpoints: list[str], mode: str = "aio") -> None:
    """A picker that decides nothing (``--floor``): round robin over ``endpoints``, every
    body sent back as it came, on the same gRPC server and message code as kvroute's."""
    import itertools

    import grpc
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc

    from router.epp import protocol as P

    turn = itertools.cycle(endpoints)

    class Echo(ep_grpc.ExternalProcessorServicer):
        async def Process(self, request_iterator: Any, context: Any) -> None:
            size = 0
            held: list[bytes] = []  # the body, until its end: the pick answers first
            while True:
                req = await context.read()
                if req is grpc.aio.EOF:
                    return
                which = req.WhichOneof("request")
                out: list[Any] = []
                if which == "request_body":
                    b = req.request_body
                    size += len(b.body)
                    held.append(b.body)
                    if b.end_of_stream:
                        out = [P.pick_headers_response(next(turn), size)]
                        for i, chunk in enumerate(held):
                            out += P.body_responses(True, chunk, i == len(held) - 1)
                elif which == "response_headers":
                    out = [P.headers_response(False)]
                elif which == "response_body":
                    b = req.response_body
                    out = list(P.body_responses(False, b.body, b.end_of_stream))
                elif which in ("request_trailers", "response_trailers"):
                    out = [P.trailers_response(which == "request_trailers")]
                for r in out:
                    await context.write(r)

    class SyncEcho(ep_grpc.ExternalProcessorServicer):
        """The same, on grpc's synchronous server (a thread per stream)."""

        def Process(self, request_iterator: Any, context: Any) -> Any:
            size = 0
            held: list[bytes] = []
            for req in request_iterator:
                which = req.WhichOneof("request")
                if which == "request_body":
                    b = req.request_body
                    size += len(b.body)
                    held.append(b.body)
                    if b.end_of_stream:
                        yield P.pick_headers_response(next(turn), size)
                        for i, chunk in enumerate(held):
                            yield from P.body_responses(True, chunk, i == len(held) - 1)
                elif which == "response_headers":
                    yield P.headers_response(False)
                elif which == "response_body":
                    b = req.response_body
                    yield from P.body_responses(False, b.body, b.end_of_stream)
                elif which in ("request_trailers", "response_trailers"):
                    yield P.trailers_response(which == "request_trailers")

    def run_sync() -> None:
        from concurrent import futures

        from grpc_health.v1 import health, health_pb2, health_pb2_grpc

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=64))
        ep_grpc.add_ExternalProcessorServicer_to_server(SyncEcho(), server)
        checker = health.HealthServicer()
        checker.set(
            "envoy.service.ext_proc.v3.ExternalProcessor", health_pb2.HealthCheckResponse.SERVING
        )
        health_pb2_grpc.add_HealthServicer_to_server(checker, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        print("echo ext_proc on", port, flush=True)
        server.wait_for_termination()

    async def run_server() -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        from grpc_health.v1.health import aio as health_aio

        server = grpc.aio.server()
        ep_grpc.add_ExternalProcessorServicer_to_server(Echo(), server)
        health = health_aio.HealthServicer()  # Envoy health-checks its ext_proc service
        await health.set(
            "envoy.service.ext_proc.v3.ExternalProcessor", health_pb2.HealthCheckResponse.SERVING
        )
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        print("echo ext_proc on", port, flush=True)
        await server.wait_for_termination()

    if mode == "sync":
        run_sync()
        return
    if mode == "uvloop":
        import uvloop

        uvloop.install()
    asyncio.run(run_server())


def start_echo(urls: list[str], mode: str = "aio") -> tuple[Proc, int]:
    port = free_port()
    endpoints = ",".join(u.split("//", 1)[1] for u in urls)
    p = subprocess.Popen(
        [sys.executable, __file__, str(port), endpoints, mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert p.stdout is not None
    p.stdout.readline()
    return Proc(f"echo-{mode}", p), port


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    serve_echo(int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3])
