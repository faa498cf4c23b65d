"""One Redis URL of a process: its client, its circuit breaker, and the calls' deadlines.

Every Redis call of the stores (:class:`~scoring.index.redis.RedisIndex`,
:class:`~scoring.index.redis_load.RedisLoadStore`, ``router.decision.owners.RedisOwnerStore``)
goes through :meth:`RedisGuard.call`, which

* refuses it at once while the breaker is open (:mod:`scoring.index.breaker`);
* bounds it by a deadline (``asyncio.timeout``, covering the wait for a connection,
  connecting and the reply): ``request_deadline_s`` (default 0.1 s) for the calls a
  routed request waits on -- index lookup, load snapshot and updates, owner get/put --
  and ``background_deadline_s`` (default 5 s, redis-py's own socket timeout) for the
  rest: the indexer's write batches, sweeps, the writer lease, gauges, heartbeats;
* turns any failure into :class:`~scoring.index.breaker.SharedStateUnavailable`
  (``kind`` timeout / connection / server), so that a caller catches one type; the
  error replies of a request that the server did answer (READONLY, OOM, a script
  error) are raised as they are (``wrap_errors=False``, the writes' choice) or wrapped
  with ``kind`` "error" (the request path's);
* after a timeout or a connection failure, drops the pool's idle connections (in the
  background): they lead to the same dead or hung server, and a pool full of them would
  fail call after call, probe after probe, long after the server is back.  Fresh
  connections are opened on demand;
* retries an idempotent call once, at once, on a connection error (a pooled
  connection the server closed); writes that count (the index's add/remove) are never
  resent.

Why 0.1 s for the request path: a healthy lookup takes 0.7-1.8 ms at p99 for up to 256
pods and 4.5 ms for 1,000 (docs/redis.md), and the longest thing a lookup can queue
behind on the single-threaded server is one write script of ``batch_keys`` = 4,096 keys
(~20 ms at the measured 200K keys/s): 0.1 s is 4x that sum, and leaves room for the
router's own event-loop lag (a deadline fires late, but a reply that arrives during a
stall may lose to the timer).  A request waits on at most four such calls (owner,
lookup, snapshot, begin), so a hung Redis adds at most ~0.4 s to the few requests sent
before the breaker opens -- below a typical time to first token, and the breaker then
makes every call fail in microseconds.

:meth:`RedisGuard.from_url` configures the client for this: connect and socket
timeouts equal to the background deadline (a backstop for any call outside a guard),
and no retries inside redis-py (its default, 10 retries with backoff, resends
non-idempotent writes and multiplies the time a call can hang).  A client passed in
directly is used as it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (
    BusyLoadingError,
    ClusterDownError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from scoring.index.breaker import CircuitBreaker, SharedStateUnavailable

__all__ = [
    "BACKGROUND_DEADLINE_S",
    "REQUEST_DEADLINE_S",
    "RedisGuard",
]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: deadline of the calls a routed request waits on (see the module docstring)
REQUEST_DEADLINE_S = 0.1
#: deadline of every other call: a write batch, a sweep page, a lease claim
BACKGROUND_DEADLINE_S = 5.0

#: error replies meaning "the server cannot serve now" (a failure, like a timeout)
_SERVER_BUSY = ("BUSY", "LOADING", "MASTERDOWN", "TRYAGAIN", "CLUSTERDOWN")


def classify(exc: BaseException) -> str | None:
    """The breaker's ``kind`` of a store error, or None when it is not one."""
    if isinstance(exc, BusyLoadingError | TryAgainError | ClusterDownError):
        return "server"
    if isinstance(exc, TimeoutError | RedisTimeoutError):
        return "timeout"
    if isinstance(exc, RedisConnectionError | OSError):
        return "connection"
    if isinstance(exc, ResponseError):
        return "server" if str(exc).startswith(_SERVER_BUSY) else "error"
    if isinstance(exc, aioredis.RedisError):
        return "error"
    return None


class RedisGuard:
    """A Redis client with a breaker and deadlines; share one per URL in a process.

    ``client`` -- a ``redis.asyncio.Redis`` with ``decode_responses=False``; ``breaker``
    -- shared with whoever else calls this server (default: a new one named after the
    client); ``owns_client`` -- :meth:`aclose` closes it.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        breaker: CircuitBreaker | None = None,
        request_deadline_s: float = REQUEST_DEADLINE_S,
        background_deadline_s: float = BACKGROUND_DEADLINE_S,
        owns_client: bool = False,
    ) -> None:
        for name, v in (
            ("request_deadline_s", request_deadline_s),
            ("background_deadline_s", background_deadline_s),
        ):
            if not isinstance(v, int | float) or isinstance(v, bool) or not v > 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
        self.client = client
        self.breaker = breaker or CircuitBreaker(name=_describe(client))
        self.request_deadline_s = float(request_deadline_s)
        self.background_deadline_s = float(background_deadline_s)
        self._owns = owns_client
        self._dropping: asyncio.Task[None] | None = None
        #: times the idle connections were dropped after a failure
        self.pool_resets = 0

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        breaker: CircuitBreaker | None = None,
        request_deadline_s: float = REQUEST_DEADLINE_S,
        background_deadline_s: float = BACKGROUND_DEADLINE_S,
        **client_kwargs: Any,
    ) -> RedisGuard:
        """A guard owning a new client for ``url``, configured as the module says
        (``client_kwargs`` override: ``socket_timeout``, ``connection_class``...)."""
        kwargs: dict[str, Any] = {
            "decode_responses": False,
            "socket_timeout": background_deadline_s,
            "socket_connect_timeout": background_deadline_s,
            "retry": Retry(NoBackoff(), 0),
        }
        kwargs.update(client_kwargs)
        client = aioredis.Redis.from_url(url, **kwargs)
        return cls(
            client,
            breaker=breaker or CircuitBreaker(name=f"redis {_redact(url)}"),
            request_deadline_s=request_deadline_s,
            background_deadline_s=background_deadline_s,
            owns_client=True,
        )

    async def call(
        self,
        op: str,
        fn: Callable[[], Awaitable[T]],
        *,
        request: bool,
        idempotent: bool = True,
        wrap_errors: bool = True,
    ) -> T:
        """``await fn()`` under the breaker and a deadline (see the module docstring).

        ``op`` names the operation in errors and metrics; ``request`` -- a routed
        request waits on it (the short deadline); ``idempotent`` -- safe to send twice
        (retried once on a connection error); ``wrap_errors`` -- raise error replies
        (READONLY, OOM...) as :class:`SharedStateUnavailable` too, not only failures.
        """
        breaker = self.breaker
        probe = breaker.admit(op)
        deadline = self.request_deadline_s if request else self.background_deadline_s
        verdict = False
        try:
            timer = asyncio.timeout(deadline)
            try:
                async with timer:
                    try:
                        result = await fn()
                    except RedisConnectionError as exc:
                        # not after the deadline: redis-py may turn the timer's
                        # cancellation into a connection error, and a retry would then
                        # run with no deadline left to stop it
                        if not idempotent or timer.expired() or isinstance(exc, BusyLoadingError):
                            raise
                        result = await fn()  # on another (fresh) connection
            except (aioredis.RedisError, OSError) as exc:
                kind = "timeout" if timer.expired() else classify(exc) or "error"
                verdict = True
                breaker.failure(op, kind, probe)
                if kind in ("timeout", "connection"):
                    self._drop_idle_connections()
                if kind == "error" and not wrap_errors:
                    raise
                detail = f"no answer within {deadline:g}s" if kind == "timeout" else str(exc)
                raise SharedStateUnavailable(op, kind, detail) from exc
            verdict = True
            breaker.success(probe)
            return result
        finally:
            if not verdict:
                breaker.abandon(probe)

    def _drop_idle_connections(self) -> None:
        """Disconnect the pool's idle connections, once at a time, in the background."""
        if self._dropping is not None and not self._dropping.done():
            return
        pool = getattr(self.client, "connection_pool", None)
        if pool is None:
            return
        self.pool_resets += 1
        self._dropping = asyncio.get_running_loop().create_task(self._drop(pool))

    @staticmethod
    async def _drop(pool: Any) -> None:
        try:
            await pool.disconnect(inuse_connections=False)
        except Exception as exc:  # a closing socket can fail to close: it is gone anyway
            log.debug("dropping idle redis connections: %s", exc)

    async def aclose(self) -> None:
        """Close the client if this guard created it (:meth:`from_url`)."""
        if self._dropping is not None:
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await self._dropping
            self._dropping = None
        if self._owns:
            await self.client.aclose()


def _redact(url: str) -> str:
    """``url`` without its password (for log lines and the breaker's name)."""
    if "@" not in url:
        return url
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"


def _describe(client: Any) -> str:
    kw = getattr(getattr(client, "connection_pool", None), "connection_kwargs", {}) or {}
    if "host" in kw:
        return f"redis {kw['host']}:{kw.get('port', 6379)}"
    return "redis"
