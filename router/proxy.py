"""Forwarding a decided request to its pod: one pooled HTTP/1.1 client, retry before the
first byte, streaming passthrough, cancellation on client disconnect.

Semantics:

* **Retry** — an attempt fails *before any byte reached the client* when connecting
  fails (refused, connect timeout) or the pod answers 502/503.  Then the request goes to
  the next pod of the ranking (at most ``proxy.retries`` times).  Once a response status
  other than 502/503 arrived, the request is committed to that pod: nothing is retried
  after bytes went out.  The final 502/503 of the last attempt is passed through.
* **Streaming** — the upstream body is relayed chunk by chunk as it arrives
  (``aiter_raw``), never buffered whole.  TTFT at the router = time from the request's
  arrival to the first body chunk sent.
* **Disconnect** — while waiting for a non-streaming response, the client connection is
  watched; when it closes, the upstream request is cancelled (its connection closed, so
  the engine aborts the request).  A streaming response stops, and closes upstream, as
  soon as the server reports the disconnect.
* **Load** — the chosen pod's router-tracked load is held from just before the attempt
  to the end of the response: prefill tokens until the first body chunk (or the whole
  non-streaming body), in-flight until the last.
* **Errors** — connect failures after the last retry -> 502, read timeout -> 504,
  other transport errors -> 502; all as OpenAI error JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from router.config import ProxySettings
from router.errors import RouterError
from router.load import LoadStore, RequestLoad
from router.metrics import RouterMetrics
from router.pods import PodRegistry
from router.routing import Routed
from scoring.policies.base import Policy

log = logging.getLogger(__name__)

RETRYABLE_STATUS = frozenset({502, 503})

#: request headers not forwarded (hop-by-hop, or recomputed by the client)
_DROP_REQUEST = frozenset(
    {
        "host",
        "content-length",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "upgrade",
        "proxy-authorization",
        "proxy-connection",
        "accept-encoding",
        "expect",
    }
)
#: response headers not passed back
_DROP_RESPONSE = frozenset(
    {"content-length", "connection", "keep-alive", "transfer-encoding", "date", "server"}
)


def make_client(settings: ProxySettings) -> httpx.AsyncClient:
    """The one pooled client: keep-alive, HTTP/1.1, configurable timeouts."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(
            connect=settings.connect_timeout_s,
            read=settings.read_timeout_s,
            write=settings.read_timeout_s,
            pool=settings.connect_timeout_s,
        ),
        limits=httpx.Limits(
            max_connections=settings.max_connections,
            max_keepalive_connections=settings.max_keepalive,
            keepalive_expiry=30.0,
        ),
        http1=True,
        http2=False,
        follow_redirects=False,
        trust_env=False,
    )


class _Disconnected(Exception):
    pass


class UpstreamBroken(RuntimeError):
    """A pod's streaming response broke after bytes reached the client."""


class _Once:
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


class _RelayResponse(StreamingResponse):
    """A streaming response that always runs ``on_close`` (finished, failed or the client
    went away — even before the first chunk, when the body generator never started)."""

    def __init__(self, *args: Any, on_close: _Once, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            await self.on_close()


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _race_disconnect(work: Awaitable[Any], receive: Receive) -> Any:
    """Await ``work``; if the client disconnects first, cancel it and raise _Disconnected."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watch.cancel()
        raise
    if task.done():
        watch.cancel()
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise _Disconnected()


class Proxy:
    def __init__(
        self,
        client: httpx.AsyncClient,
        settings: ProxySettings,
        registry: PodRegistry,
        load: LoadStore,
        policy: Policy,
        metrics: RouterMetrics,
        *,
        policy_name: str,
        pod_header: str,
        forward_authorization: bool,
    ) -> None:
        self.client = client
        self.settings = settings
        self.registry = registry
        self.load = load
        self.policy = policy
        self.metrics = metrics
        self.policy_name = policy_name
        self.pod_header = pod_header
        self.forward_authorization = forward_authorization

    def _headers(self, incoming: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
        out = [
            (k, v)
            for k, v in incoming
            if k.decode("latin-1").lower() not in _DROP_REQUEST
            and (self.forward_authorization or k.lower() != b"authorization")
        ]
        out.append((b"accept-encoding", b"identity"))
        return out

    def _count(self, routed: Routed, pod: str, status: int) -> None:
        self.metrics.requests.labels(routed.model, pod, str(status), self.policy_name).inc()

    async def forward(
        self,
        routed: Routed,
        path: str,
        raw_body: bytes,
        headers: list[tuple[bytes, bytes]],
        receive: Receive,
        started: float,
    ) -> Response:
        """Send ``routed`` to its best pod (retrying as documented) and relay the answer."""
        out_headers = self._headers(headers)
        attempts = routed.ranking[: 1 + self.settings.retries]
        last_error: RouterError | None = None
        for i, pod in enumerate(attempts):
            state = self.registry.get(pod)
            if state is None:  # vanished between decision and send
                continue
            last = i == len(attempts) - 1
            if i > 0:
                self.metrics.retries.labels(last_error.reason if last_error else "unknown").inc()
            load = RequestLoad(self.load, pod, routed.route.prompt_tokens)
            await load.begin()
            gauge = self.metrics.inflight.labels(pod)
            gauge.inc()
            req = self.client.build_request(
                "POST", state.spec.url.rstrip("/") + path, content=raw_body, headers=out_headers
            )
            try:
                resp: httpx.Response = await _race_disconnect(
                    self.client.send(req, stream=True), receive
                )
            except _Disconnected:
                await self._finish(load, gauge, routed, pod)
                self._count(routed, pod, 499)
                return Response(status_code=499)
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
                await self._finish(load, gauge, routed, pod)
                self.metrics.upstream_errors.labels(pod, "connect").inc()
                last_error = RouterError(
                    502, f"cannot connect to pod {pod}: {exc!r}", reason="connect"
                )
                continue
            except httpx.TimeoutException:
                await self._finish(load, gauge, routed, pod)
                self.metrics.upstream_errors.labels(pod, "timeout").inc()
                self._count(routed, pod, 504)
                return RouterError(
                    504, f"pod {pod} did not answer in time", reason="upstream_timeout"
                ).response({self.pod_header: pod})
            except httpx.HTTPError as exc:
                await self._finish(load, gauge, routed, pod)
                self.metrics.upstream_errors.labels(pod, "transport").inc()
                last_error = RouterError(502, f"pod {pod} failed: {exc!r}", reason="transport")
                self._count(routed, pod, 502)
                return last_error.response({self.pod_header: pod})

            if resp.status_code in RETRYABLE_STATUS and not last:
                await resp.aclose()
                await self._finish(load, gauge, routed, pod)
                self.metrics.upstream_errors.labels(pod, f"status_{resp.status_code}").inc()
                last_error = RouterError(
                    resp.status_code,
                    f"pod {pod} answered {resp.status_code}",
                    reason=f"status_{resp.status_code}",
                )
                continue
            self.policy.on_routed(routed.route, pod)
            return await self._relay(resp, routed, pod, load, gauge, receive, started)

        self._count(routed, attempts[-1] if attempts else "none", 502)
        err = last_error or RouterError(503, "no pod available", reason="no_pod")
        return err.response()

    async def _finish(self, load: RequestLoad, gauge: Any, routed: Routed, pod: str) -> None:
        gauge.dec()
        await load.end()

    async def _relay(
        self,
        resp: httpx.Response,
        routed: Routed,
        pod: str,
        load: RequestLoad,
        gauge: Any,
        receive: Receive,
        started: float,
    ) -> Response:
        headers = {k: v for k, v in resp.headers.items() if k.lower() not in _DROP_RESPONSE}
        headers[self.pod_header] = pod
        is_stream = routed.stream or resp.headers.get("content-type", "").startswith(
            "text/event-stream"
        )
        if not is_stream:
            try:
                content: bytes = await _race_disconnect(resp.aread(), receive)
            except _Disconnected:
                self._count(routed, pod, 499)
                return Response(status_code=499)
            except httpx.TimeoutException:
                self.metrics.upstream_errors.labels(pod, "timeout").inc()
                self._count(routed, pod, 504)
                return RouterError(
                    504, f"pod {pod} did not finish in time", reason="upstream_timeout"
                ).response({self.pod_header: pod})
            except httpx.HTTPError as exc:
                self.metrics.upstream_errors.labels(pod, "transport").inc()
                self._count(routed, pod, 502)
                return RouterError(
                    502, f"pod {pod} failed mid-response: {exc!r}", reason="transport"
                ).response({self.pod_header: pod})
            finally:
                await resp.aclose()
                await self._complete(load, gauge, routed, pod)
            self._count(routed, pod, resp.status_code)
            return Response(content, status_code=resp.status_code, headers=headers)

        done = _Once(self._complete, load, gauge, routed, pod)
        return _RelayResponse(
            self._stream(resp, routed, pod, load, started),
            status_code=resp.status_code,
            headers=headers,
            on_close=done,
        )

    async def _stream(
        self, resp: httpx.Response, routed: Routed, pod: str, load: RequestLoad, started: float
    ) -> AsyncIterator[bytes]:
        first = True
        status = resp.status_code
        try:
            async for chunk in resp.aiter_raw():
                if first and chunk:
                    first = False
                    self.metrics.ttft_seconds.labels(routed.model).observe(
                        time.perf_counter() - started
                    )
                    await load.first_token()
                yield chunk
        except httpx.HTTPError as exc:
            # bytes may already be out: no retry, no JSON error.  Re-raise so the server
            # aborts the client connection too (no clean end: the client sees truncation)
            status = 502
            self.metrics.upstream_errors.labels(pod, "stream_broken").inc()
            log.warning("stream from %s broke: %r", pod, exc)
            raise UpstreamBroken(f"stream from pod {pod} broke: {exc!r}") from None
        except asyncio.CancelledError:
            status = 499
            raise
        finally:
            await resp.aclose()
            self._count(routed, pod, status)

    async def _complete(self, load: RequestLoad, gauge: Any, routed: Routed, pod: str) -> None:
        gauge.dec()
        await load.end()
        self.policy.on_complete(routed.route, pod)
