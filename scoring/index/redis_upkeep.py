"""Upkeep of a Redis index namespace, for the process that writes it (``kvroute index``):
the writer lease, the sweep of the holder hints and the epoch, in :class:`IndexUpkeep`,
the base class of :class:`~scoring.index.redis.RedisIndex` (whose docstring describes
them)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript

from scoring.index.breaker import SharedStateUnavailable
from scoring.index.redis_guard import RedisGuard
from scoring.index.redis_keys import Layout, raise_if_cancelled

__all__ = ["IndexUpkeep"]

T = TypeVar("T")

#: the index's logger (these methods were part of :mod:`scoring.index.redis`)
log = logging.getLogger("scoring.index.redis")


class IndexUpkeep:
    """The maintenance calls of :class:`~scoring.index.redis.RedisIndex`; the attributes
    they use are set by ``RedisIndex.__init__``."""

    namespace: str
    guard: RedisGuard
    swept: int
    sweep_errors: int
    _k: Layout
    _r: aioredis.Redis
    _ttl_arg: bytes
    _sweep: AsyncScript
    _claim_writer: AsyncScript
    _release_writer: AsyncScript

    async def _background(self, op: str, fn: Callable[[], Awaitable[T]]) -> T:
        """A maintenance call (idempotent) under the guard's background deadline."""
        return await self.guard.call(op, fn, request=False, wrap_errors=False)

    # -- the writer lease ----------------------------------------------------------------

    async def claim_writer(self, holder: str, lease_s: float) -> str | None:
        """Take or renew this namespace's writer lease for ``holder`` (it expires
        ``lease_s`` after the last claim); None when ``holder`` holds it, else whoever
        does.  One process should apply KV events to a namespace: two apply every event
        twice and each one's resync clears the pod under the other's bookkeeping."""
        cur = await self._background(
            "writer_lease",
            lambda: self._claim_writer(keys=[self._k.writer], args=[holder, int(lease_s * 1000)]),
        )
        return None if cur is None else (cur.decode() if isinstance(cur, bytes) else str(cur))

    async def writer(self) -> str | None:
        """Who holds the writer lease now (None: nobody)."""
        cur = await self._background("writer_lease", lambda: self._r.get(self._k.writer))
        return None if cur is None else (cur.decode() if isinstance(cur, bytes) else str(cur))

    async def release_writer(self, holder: str) -> None:
        """Give the writer lease up if ``holder`` holds it."""
        await self._background(
            "writer_lease", lambda: self._release_writer(keys=[self._k.writer], args=[holder])
        )

    # -- maintenance -------------------------------------------------------------------

    async def sweep(self, count: int = 1000) -> int:
        """Delete retired (cleared) and stale slot ids from the holder hints; returns how many.

        Not on any request path: it HSCANs this namespace's hint hash in pages of
        ``count`` and cleans each page with one script.  Needed only when ``ttl_s`` is
        disabled, or to reclaim memory before the TTL does.
        """
        k = self._k
        removed = 0
        cursor: int = 0
        while True:
            # fields and values (HSCAN NOVALUES needs Redis 7.4 / Valkey 8)
            cursor, found = await self._background(
                "sweep", partial(self._r.hscan, k.hints, cursor=cursor, count=count)
            )
            page = list(found)
            if page:
                removed += int(
                    await self._background(
                        "sweep",
                        partial(
                            self._sweep,
                            keys=[k.ids, k.seen, k.hints, k.digests],
                            args=[k.prefix, self._ttl_arg, *page],
                        ),
                    )
                )
            if cursor == 0:
                return removed

    async def sweep_forever(self, interval_s: float = 300.0) -> None:
        """Run :meth:`sweep` every ``interval_s`` seconds until cancelled.

        For the process that writes the index (``kvroute index``): start it as a task
        in its lifespan.  A failed sweep is logged and counted (``sweep_errors``), and
        the loop goes on; ``swept`` counts the hint entries removed so far.
        """
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s!r}")
        while True:
            await asyncio.sleep(interval_s)
            try:
                self.swept += await self.sweep()
            except (SharedStateUnavailable, aioredis.RedisError, OSError) as exc:
                raise_if_cancelled(exc)
                self.sweep_errors += 1
                log.warning("sweep of redis index %r failed: %s", self.namespace, exc)
            raise_if_cancelled()

    async def block_keys(self) -> int:
        """Number of distinct blocks held by any slot in this namespace (hint fields)."""
        return int(await self._background("block_keys", lambda: self._r.hlen(self._k.hints)))

    # -- the epoch -----------------------------------------------------------------------

    async def epoch(self) -> str | None:
        """The namespace's epoch (None: there is none -- never written, or lost)."""
        cur = await self._background("epoch", lambda: self._r.get(self._k.epoch))
        return None if cur is None else _text(cur)

    async def ensure_epoch(self) -> str:
        """The namespace's epoch, created (a new random id) when there is none.

        For the process that writes the index: call it when it starts and then
        periodically (with each lease claim); an answer different from the previous
        one means Redis lost this namespace's data since (it restarted without
        persistence, or was flushed), so every pod must be cleared and learned again.
        One round trip (``SET NX GET``: atomic, so two writers agree on one epoch).
        """
        new = uuid.uuid4().hex
        old = await self._background(
            "epoch", lambda: self._r.set(self._k.epoch, new, nx=True, get=True)
        )
        return new if old is None else _text(old)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
