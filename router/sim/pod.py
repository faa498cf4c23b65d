"""One simulated vLLM pod: HTTP API + KV-event publisher + engine, in the running loop.

Several pods can live in one process (the embedded fleet, tests, benchmarks): each
has its own engine, metrics registry, sockets and uvicorn server.  The server runs
as a task in the caller's event loop and never touches process signal handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI

from router.sim.api import build_app
from router.sim.disagg import SimDisagg
from router.sim.engine import SimEngine
from router.sim.events import KVEventPublisher
from router.sim.settings import SimSettings
from router.sim.vllm_engine import VllmSimEngine
from router.tokenize import load_tokenizer


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without signal capture: the embedding program owns signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class SimPod:
    """A simulated vLLM pod.  ``await start()``, use ``url`` / ``events_endpoint``,
    ``await stop()``."""

    def __init__(self, settings: SimSettings) -> None:
        self.settings = settings
        self.tokenizer = load_tokenizer(settings.tokenizer)
        self.engine: SimEngine = (
            VllmSimEngine(settings) if settings.pod_model == "vllm" else SimEngine(settings)
        )
        self.disagg = SimDisagg(settings, self.engine)
        self.app: FastAPI = build_app(settings, self.engine, self.tokenizer, self.disagg)
        self.publisher: KVEventPublisher | None = None
        if settings.kv_events:
            self.publisher = KVEventPublisher(
                settings.kv_endpoint,
                settings.replay_endpoint,
                settings.event_topic,
                buffer_steps=settings.replay_buffer,
            )
        self._server: _EmbeddedServer | None = None
        self._task: asyncio.Task[None] | None = None
        self._sock: socket.socket | None = None
        self.url: str = ""
        #: the concrete tcp://127.0.0.1:PORT a subscriber dials (None in connect mode
        #: or with events off)
        self.events_endpoint: str | None = None
        self.replay_endpoint_url: str | None = None

    @property
    def name(self) -> str:
        return self.settings.pod_name

    @property
    def topic(self) -> str:
        return self.settings.event_topic

    async def start(self) -> None:
        if self._task is not None:
            raise RuntimeError(f"sim pod {self.name} is already started")
        if self.publisher is not None:
            await self.publisher.start()
            self.engine.sink = self.publisher.publish
            self.events_endpoint = self.publisher.endpoint
            self.replay_endpoint_url = self.publisher.replay_endpoint
        s = self.settings
        # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY on accepted sockets only
        # when the listening socket says TCP; without it every response written in two
        # parts (headers, body) waits ~40 ms for the client's delayed ACK (Nagle)
        family = socket.AF_INET6 if ":" in s.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            sock.bind((s.host, s.port))
        except OSError:
            sock.close()
            await self._stop_publisher()
            raise
        sock.listen(2048)
        sock.setblocking(False)
        self._sock = sock
        port = sock.getsockname()[1]
        host = "127.0.0.1" if s.host in ("0.0.0.0", "") else s.host
        self.url = f"http://{host}:{port}"
        self.disagg.side_channel = (host, port)
        config = uvicorn.Config(
            self.app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=2,
            timeout_keep_alive=30,
        )
        self._server = _EmbeddedServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                await self._task  # surfaces the startup error
                raise RuntimeError(f"sim pod {self.name}: HTTP server exited during startup")
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._server, self._task = None, None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        await self.disagg.close()
        await self.engine.close()
        await self._stop_publisher()

    async def _stop_publisher(self) -> None:
        self.engine.sink = None
        if self.publisher is not None:
            await self.publisher.stop()

    def reset_prefix_cache(self) -> None:
        """Clear the cache; publishes AllBlocksCleared."""
        self.engine.reset_prefix_cache()

    async def __aenter__(self) -> SimPod:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
