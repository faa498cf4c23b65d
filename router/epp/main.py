"""`kvroute epp`: kvroute's decision as a Gateway API Inference Extension Endpoint Picker.

An InferencePool's proxy (Envoy in Istio, kgateway, Envoy Gateway, GKE...) calls it over
Envoy's ext_proc gRPC protocol for every request and sends the request to the pod it
names: the same decision as `kvroute serve`, without a second proxy hop.

Usage::

    kvroute epp [--grpc-host 0.0.0.0] [--grpc-port 9002] \\
        [--metrics-host 0.0.0.0] [--metrics-port 9090] [--endpoints 1] \\
        [--grpc-server h2|grpcio] [--loop uvloop|asyncio] \\
        [--config FILE] [any `kvroute serve` setting flag]

Settings come from the same model as ``kvroute serve`` (``--config`` YAML, ``KVROUTE_*``
env, flags): discovery (an InferencePool's ``selector`` and ``targetPorts`` are
``discovery.kind: k8s`` with that label selector and port), KV events or the Redis
index, the policy, tokenizers, scraping.  The proxy-only settings (``host``, ``port``,
``workers``, ``proxy.retries`` and timeouts, ``api_keys``) do not apply: the gateway
owns the connection, its retries and its authentication.  ``proxy.max_body_bytes``
still bounds the request bodies the picker reads (413 beyond).  With no pods
configured, the embedded simulated fleet starts as it does for `kvroute serve`.

``--endpoints N`` returns the N best pods as an ordered ``ip:port,...`` list for a proxy
that retries down it; Envoy's ``ORIGINAL_DST`` cluster takes one (the default).

SIGINT / SIGTERM: readiness goes NOT_SERVING, open streams get
``shutdown_grace_s`` to finish, then the process exits 0.  See docs/gateway.md.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Callable, Sequence

from router.config import Settings
from router.epp.fronts import SERVERS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvroute epp",
        description="Run kvroute as a Gateway API Inference Extension Endpoint Picker "
        "(Envoy ext_proc over gRPC). Other flags (--config FILE, --discovery.kind k8s, "
        "...) are `kvroute serve` settings.",
        epilog="example: kvroute epp --grpc-host 0.0.0.0 --config router.yaml "
        "(discovery kind k8s with the InferencePool's selector; docs/gateway.md has the "
        "Envoy side; `kvroute serve --help` shows every setting)",
    )
    p.add_argument("--grpc-host", default="127.0.0.1", help="listen address of ext_proc")
    p.add_argument("--grpc-port", type=int, default=9002, help="ext_proc and gRPC health port")
    p.add_argument("--metrics-host", default="127.0.0.1", help="listen address of /metrics")
    p.add_argument("--metrics-port", type=int, default=9090, help="/metrics, /health port")
    p.add_argument(
        "--grpc-server",
        choices=SERVERS,
        default="h2",
        help="the gRPC server of ext_proc and health: h2 (HTTP/2 on the event loop, the "
        "default) or grpcio (grpc.aio); docs/gateway.md compares them",
    )
    p.add_argument(
        "--loop",
        choices=("uvloop", "asyncio"),
        default="uvloop",
        help="the event loop (uvloop, the default; asyncio's own)",
    )
    p.add_argument(
        "--endpoints",
        type=int,
        default=1,
        metavar="N",
        help="pods per pick, best first (a list for a proxy that retries down it; "
        "Envoy's ORIGINAL_DST cluster takes 1)",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args, rest = _parser().parse_known_args(list(argv or []))
    if args.endpoints < 1:
        print(f"kvroute epp: --endpoints must be >= 1, got {args.endpoints}", file=sys.stderr)
        return 2
    try:
        settings = Settings.load(rest)
    except (ValueError, FileNotFoundError) as exc:
        print(f"kvroute epp: {exc}", file=sys.stderr, flush=True)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)
    fleet = None
    if (
        settings.discovery.kind == "static"
        and not settings.discovery.static
        and settings.fleet.enabled
    ):
        from router.fleet.embedded import EmbeddedFleet

        fleet = EmbeddedFleet(settings.fleet)
        fleet.start()
        settings = fleet.attach(settings)
    try:
        with asyncio.Runner(loop_factory=_loop_factory(args.loop)) as runner:
            runner.run(_serve(settings, args))
    except OSError as exc:  # a port taken, discovery failing at start...
        print(f"kvroute epp: {exc}", file=sys.stderr, flush=True)
        return 2
    finally:
        if fleet is not None:
            fleet.stop()
    return 0


def _loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    if name == "uvloop":
        import uvloop

        return uvloop.new_event_loop
    return None


async def _serve(settings: Settings, args: argparse.Namespace) -> None:
    from router.epp.picker import EndpointPicker
    from router.epp.server import EppServer

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    server = EppServer(
        EndpointPicker(settings, endpoints=args.endpoints),
        grpc_host=args.grpc_host,
        grpc_port=args.grpc_port,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        grpc_server=args.grpc_server,
    )
    await server.start()
    print(
        f"kvroute epp: ext_proc on {server.grpc_address}, metrics on {server.metrics_url}",
        flush=True,
    )
    try:
        await stop.wait()
    finally:
        await server.stop(grace_s=float(settings.shutdown_grace_s))
