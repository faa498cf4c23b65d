"""`kvroute serve`: run the router (uvicorn, ``--workers N`` processes).

With no pods configured (static discovery, empty list) and ``fleet.enabled``, an
embedded simulated fleet (:mod:`router.fleet.embedded`) is started first and the router is
pointed at it, so ``kvroute serve`` answers at once on a fresh machine.  SIGINT /
SIGTERM stop uvicorn, then the fleet.

:class:`RunningServer` runs any ASGI app on a loopback port inside the current event
loop (used by the embedded fleet's callers and by the tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

import uvicorn

from router import metrics_share
from router.preflight import StartupError, check_settings, load_settings, unknown_env
from router.proxy.protocol import OneWriteHttpToolsProtocol

log = logging.getLogger(__name__)

SETTINGS_ENV = "KVROUTE_SERVE_SETTINGS_JSON"


def _loop_impl() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"


def _http_impl() -> Any:
    """uvicorn's HTTP protocol: :class:`~router.proxy.protocol.OneWriteHttpToolsProtocol`
    (the client limits, one write per response) when httptools is installed (it is a
    dependency), else h11 (without the limits)."""
    try:
        import httptools  # noqa: F401
    except ImportError:
        return "h11"
    return OneWriteHttpToolsProtocol


class _InLoopServer(uvicorn.Server):
    """A uvicorn server that leaves signal handling to whoever owns the loop."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class RunningServer:
    """An ASGI app served by uvicorn on ``host:port`` (0 = a free port) in this loop.

    ``await start()`` returns once the socket listens and the lifespan has started;
    :attr:`url` is then the base URL.  ``await stop()`` shuts it down cleanly.
    """

    def __init__(
        self,
        app: Any,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        timeout_keep_alive: float = 5,
        http: Any = None,
    ) -> None:
        """``http``: uvicorn's ``http`` setting (default: :func:`_http_impl`)."""
        # proto=IPPROTO_TCP matters: asyncio only sets TCP_NODELAY on accepted sockets
        # whose listening socket says IPPROTO_TCP (a plain socket.socket() says 0, and
        # then every small response write waits ~40 ms for a delayed ACK)
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(2048)
        self._sock.setblocking(False)
        self.host, self.port = self._sock.getsockname()[:2]
        config = uvicorn.Config(
            app,
            log_level="warning",
            lifespan="on",
            http=http or _http_impl(),
            loop="none",
            access_log=False,
            proxy_headers=False,  # as `kvroute serve` runs it
            timeout_graceful_shutdown=2,
            timeout_keep_alive=timeout_keep_alive,  # type: ignore[arg-type]
        )
        self.server = _InLoopServer(config)
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> RunningServer:
        task = self._task = asyncio.create_task(self._serve())
        while not self.server.started:
            if task.done():
                self._sock.close()
                self._task = None
                task.result()  # raises the startup error
                raise RuntimeError("server exited during startup (see the log above)")
            await asyncio.sleep(0.01)
        return self

    async def _serve(self) -> None:
        try:
            await self.server.serve(sockets=[self._sock])
        except SystemExit as exc:  # uvicorn exits when the lifespan startup fails;
            # SystemExit escaping a task would stop the whole event loop
            raise RuntimeError(f"server exited during startup (code {exc.code})") from None

    async def stop(self) -> None:
        if self._task is None:
            return
        self.server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
        self._sock.close()

    async def __aenter__(self) -> RunningServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def main(argv: Sequence[str] | None = None) -> int:
    try:  # every setting is checked before anything starts (router.preflight)
        settings = load_settings(list(argv or []))
        check_settings(settings)
    except StartupError as exc:
        for line in str(exc).splitlines():
            print(f"kvroute serve: {line}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per scrape otherwise
    for name in unknown_env():
        log.warning("%s names no setting and is ignored (see docs/config.md)", name)
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
        log.info(
            "no pods configured: embedded simulated fleet of %d pods serving %r",
            settings.fleet.pods,
            settings.fleet.model,
        )
    made_share_dir: str | None = None
    if settings.workers > 1 and not os.environ.get(metrics_share.ENV):
        # one /metrics for all workers (router.metrics_share); a directory given in the
        # environment is used as it is and left in place
        made_share_dir = tempfile.mkdtemp(prefix="kvroute-metrics-")
        os.environ[metrics_share.ENV] = made_share_dir
    # uvicorn re-raises SIGINT/SIGTERM after its own graceful shutdown; turn that into a
    # normal return so the fleet is stopped and the exit status is 0
    previous = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        os.environ[SETTINGS_ENV] = settings.model_dump_json()
        uvicorn.run(
            "router.proxy.app:app_from_env",
            factory=True,
            host=settings.host,
            port=settings.port,
            workers=settings.workers,
            loop=_loop_impl(),
            http=_http_impl(),
            log_level=settings.log_level,
            access_log=False,
            proxy_headers=False,  # the client address is not used; saves a middleware
            server_header=False,  # a gateway need not advertise uvicorn (one header less)
            timeout_graceful_shutdown=settings.shutdown_grace_s,
        )
    except _Stop:
        pass
    finally:
        os.environ.pop(SETTINGS_ENV, None)
        if made_share_dir is not None:
            os.environ.pop(metrics_share.ENV, None)
            shutil.rmtree(made_share_dir, ignore_errors=True)
        if fleet is not None:
            fleet.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


class _Stop(BaseException):
    """A stop signal arrived (after uvicorn's graceful shutdown)."""


def _raise_stop(signum: int, frame: object) -> None:
    raise _Stop()
