"""Asyncio helpers for tests: serve an ASGI app on loopback, wait for a condition.

Waiting is never a speed assertion: :func:`wait_until` polls a condition and fails
only after a generous deadline that guards against hangs (the suite runs on 2 noisy
shared cores, and CI on a clean clone).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import socket
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from typing import Any

import uvicorn


class _Server(uvicorn.Server):
    """A uvicorn server that leaves the loop's signal handlers alone."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.asynccontextmanager
async def serve_app(app: Any, certfile: str | None = None) -> AsyncIterator[str]:
    """Run the ASGI ``app`` on a free 127.0.0.1 port in this loop; yield its base URL.

    ``certfile`` (key + certificate chain, PEM): serve https instead of http."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="off", ssl_certfile=certfile)
    server = _Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        if task.done():
            task.result()  # raise the server's startup error
        await asyncio.sleep(0.01)
    try:
        yield f"{'https' if certfile else 'http'}://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        server.force_exit = True
        await task
        sock.close()


async def wait_until(
    cond: Callable[[], Any],
    what: str = "the condition",
    *,
    timeout: float = 20.0,
    interval: float = 0.01,
) -> None:
    """Poll ``cond()`` (sync, or returning an awaitable) until it is truthy.

    Raises ``AssertionError`` naming ``what`` when ``timeout`` seconds pass first.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = cond()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return
        if loop.time() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        await asyncio.sleep(interval)


@contextlib.asynccontextmanager
async def running(coro: Coroutine[Any, Any, Any]) -> AsyncIterator[asyncio.Task[Any]]:
    """Run ``coro`` as a task for the ``async with`` block, then cancel it and wait
    for it to end (an error it raised, other than the cancellation, propagates)."""
    task = asyncio.ensure_future(coro)
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
