"""The responses the proxy sends back: a complete answer with pre-built raw headers, a
streaming relay that always runs its ``on_close`` callback once, and the error that
stands for a pod's 5xx answer when its body is not relayed (tenants)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from router.errors import RouterError
from router.fleet.transport import Upstream
from router.proxy.oneshot import send_whole


class UpstreamBroken(RuntimeError):
    """A pod's streaming response broke after bytes reached the client."""


class Once:
    """Runs an async callback at most once."""

    __slots__ = ("args", "done", "fn")

    def __init__(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        self.fn = fn
        self.args = args
        self.done = False

    async def __call__(self) -> None:
        if not self.done:
            self.done = True
            await self.fn(*self.args)


class RelayResponse(StreamingResponse):
    """A streaming response that always runs ``on_close`` (finished, failed or the client
    went away — even before the first chunk, when the body generator never started)."""

    def __init__(self, *args: Any, on_close: Once, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            await self.on_close()


class RawResponse(Response):
    """A complete response with pre-built raw headers (no header normalisation: the hot
    path already holds them as bytes, names lowercase), written in one go on
    `kvroute serve`'s protocol (:func:`router.proxy.oneshot.send_whole`), else as two
    ASGI messages.  ``headers`` carry no ``content-length``: it is the body's.

    ``after`` is bookkeeping the client need not wait for; it must not raise.  It runs
    right after a one-go write, which does not yield: in the same step of the event
    loop, so no other request is decided before it.  Where the response goes as ASGI
    messages instead (an access log wraps ``send``, the client's transport is paused,
    another server), whose sends may wait for a slow client, it runs before them."""

    def __init__(
        self,
        status: int,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        after: Callable[[], None] | None = None,
    ) -> None:
        self.status_code = status
        self.body = self._content = body
        self.raw_headers = headers
        self.background = None
        self.after = after

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = self._content
        try:
            written = send_whole(send, self.status_code, self.raw_headers, body)
        finally:
            after = self.after
            if after is not None:
                self.after = None
                after()
        if written:
            return
        headers = [*self.raw_headers, (b"content-length", b"%d" % len(body))]
        await send({"type": "http.response.start", "status": self.status_code, "headers": headers})
        await send({"type": "http.response.body", "body": body})


async def relay_chunks(resp: Upstream) -> AsyncIterator[bytes]:
    try:
        async for chunk in resp.stream:
            yield chunk
    finally:
        await resp.stream.aclose()


async def pod_5xx_error(resp: Upstream, content: bytes | None, pod: str) -> RouterError:
    """The error for a pod's 5xx answer whose body is not relayed (its start in the
    message, which only the log shows); the upstream is closed."""
    if content is None:
        try:
            content = b"" if resp.is_event_stream else await resp.stream.read_all()
        except httpx.HTTPError as exc:  # the status is what the client learns anyway
            content = repr(exc).encode()
        finally:
            await resp.stream.aclose()
    return RouterError(
        resp.status,
        f"pod {pod} answered {resp.status}: {content[:512]!r}",
        reason=f"status_{resp.status}",
    )
