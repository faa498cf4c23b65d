"""A TCP relay on 127.0.0.1 that leaves its clients' connections half-open.

:class:`HalfOpenRelay` forwards each client connection to an upstream port.  When the
upstream side goes away (the server was killed), the relay does not pass the close
on: the client's socket stays open and silent, everything sent to it is dropped.
That is what a client sees of a peer that vanished without a FIN or a reset -- a node
lost, or a NAT / conntrack entry still pointing at a deleted pod's address -- which a
local ``kill`` of the server cannot produce (the kernel resets the connections).
New connections made after the upstream is back are relayed normally.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from types import TracebackType
from typing import Any


class HalfOpenRelay:
    """``async with HalfOpenRelay(upstream_port) as relay``: ``relay.port`` relays to
    127.0.0.1:``upstream_port``."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._clients: set[asyncio.StreamWriter] = set()

    async def __aenter__(self) -> HalfOpenRelay:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._clients):
            writer.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self._server.wait_closed()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._clients.add(writer)
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        except OSError:
            await _drain_forever(reader)  # no upstream: a silent peer
            return
        self._spawn(_pipe(up_reader, writer))  # upstream -> client; ends quietly
        try:  # client -> upstream
            while data := await reader.read(65536):
                up_writer.write(data)
                await up_writer.drain()
        except OSError:  # the upstream is gone: swallow whatever the client sends
            await _drain_forever(reader)
        # the client closed: close both sides
        up_writer.close()
        writer.close()
        self._clients.discard(writer)


async def _pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    """Copy ``src`` to ``dst`` until ``src`` ends; never closes ``dst``."""
    with contextlib.suppress(OSError):
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()


async def _drain_forever(reader: asyncio.StreamReader) -> None:
    with contextlib.suppress(OSError):
        while await reader.read(65536):
            pass


async def _serve(upstream_port: int) -> None:
    async with HalfOpenRelay(upstream_port) as relay:
        print(relay.port, flush=True)
        await asyncio.Event().wait()


if __name__ == "__main__":  # a relay in a process of its own: prints its port
    import sys

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(int(sys.argv[1])))
