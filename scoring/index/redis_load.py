"""The load view shared by router replicas through Redis: :class:`RedisLoadStore`.

Each replica's own counts -- in-flight requests and outstanding prefill tokens per pod
-- live in its memory; they are the truth.  Redis holds a *mirror* of them, one hash per
replica (``{ns}:load:h:<replica>``), written with absolute values, never deltas:

* ``begin`` / ``prefill_done`` / ``end`` update the local table at once (before any
  await), then wait -- at most the request deadline -- for the pod's new values to
  reach Redis.  They never raise for Redis: while it is down, hung or the breaker is
  open, only the local table changes.
* One publisher per store writes the changed pods, one round trip at a time (a change
  made while a write is in flight goes in the next one, so writes land in order and
  bursts coalesce).  After any failed write the mirror is *stale*: the next write
  replaces the replica's whole hash with its whole table (at the next change, the next
  heartbeat, or at once when the breaker closes).  A hash found without its marker
  (expired during a long partition, or lost by a restarted server) is republished
  whole the same way.  So requests begun before an outage and ended during it leave no
  residue once Redis is back (the old delta writes leaked them for good).
* ``snapshot`` sums the mirrors of the live replicas (this one's included, so the
  router's pending overlay stays right), and raises
  :class:`~scoring.index.breaker.SharedStateUnavailable` when Redis cannot answer in
  time: the caller falls back to :meth:`RedisLoadStore.local_snapshot`.
* A replica registers in the sorted set ``{ns}:load:r`` until ``now + ttl_s`` (server
  clock), refreshed by every write and by a heartbeat every ``ttl_s / 3``; its hash
  carries the same TTL, so a crashed replica's counts vanish from everyone's view after
  at most ``ttl_s``.  ``close`` withdraws them at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Iterable
from functools import partial
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript

from scoring.index import redis_lua
from scoring.index.breaker import CircuitBreaker, SharedStateUnavailable
from scoring.index.redis_guard import BACKGROUND_DEADLINE_S, REQUEST_DEADLINE_S, RedisGuard
from scoring.index.redis_keys import Layout, check_name, raise_if_cancelled

__all__ = ["RedisLoadStore"]

log = logging.getLogger(__name__)


class RedisLoadStore:
    """Router-tracked load shared by all replicas (the ``router.fleet.load.LoadStore`` protocol).

    ``client`` -- a :class:`~scoring.index.redis_guard.RedisGuard` shared with the
    process's other stores, or a ``redis.asyncio.Redis`` (wrapped in a guard of its
    own); ``replica`` -- this replica's name in the view (default: random; a stable
    name, e.g. the pod name, lets a restarted replica replace its predecessor's
    counts at its first write); ``ttl_s`` -- a replica that stops heartbeating drops
    out of the view after ``ttl_s``.
    """

    def __init__(
        self,
        client: aioredis.Redis | RedisGuard,
        *,
        namespace: str = "kvroute",
        replica: str | None = None,
        ttl_s: float = 15.0,
        owns_client: bool = False,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s!r}")
        self.replica = replica or uuid.uuid4().hex
        self._replica = check_name("replica", self.replica)
        self._k = Layout(namespace)
        self.ttl_s = ttl_s
        self._ttl_ms = str(max(1, int(ttl_s * 1000))).encode()
        self.guard = (
            client
            if isinstance(client, RedisGuard)
            else RedisGuard(client, owns_client=owns_client)
        )
        self._r = self.guard.client
        self._owns = owns_client
        self._set: AsyncScript = self._r.register_script(redis_lua.LOAD_SET)
        self._snap: AsyncScript = self._r.register_script(redis_lua.LOAD_SNAPSHOT)
        self._clear: AsyncScript = self._r.register_script(redis_lua.LOAD_CLEAR_POD)
        # the truth: this replica's counts
        self._inflight: dict[str, int] = {}
        self._tokens: dict[str, int] = {}
        # the mirror: pods changed since the last write; the whole table must be
        # written (a write failed, the hash was lost; at start: whatever a previous
        # process of this replica name left goes)
        self._dirty: set[str] = set()
        self._stale = True
        self._version = 0  # local changes so far
        self._published = 0  # changes the mirror holds
        self._publisher: asyncio.Task[None] | None = None
        self._round = asyncio.Event()  # set (and replaced) after each write
        self._closing = False
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._unlisten = self.guard.breaker.listen(on_state=self._breaker_state)
        #: heartbeats that failed (the loop keeps going; exported by the router)
        self.heartbeat_errors = 0
        #: writes of the mirror that failed (each leaves it stale until republished)
        self.write_errors = 0
        #: times the whole table was written (start, after a failure or a lost hash)
        self.republished = 0

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        namespace: str = "kvroute",
        replica: str | None = None,
        ttl_s: float = 15.0,
        breaker: CircuitBreaker | None = None,
        request_deadline_s: float = REQUEST_DEADLINE_S,
        background_deadline_s: float = BACKGROUND_DEADLINE_S,
        **client_kwargs: Any,
    ) -> RedisLoadStore:
        """A store owning a new guarded client for ``url`` (see ``RedisIndex.from_url``)."""
        guard = RedisGuard.from_url(
            url,
            breaker=breaker,
            request_deadline_s=request_deadline_s,
            background_deadline_s=background_deadline_s,
            **client_kwargs,
        )
        return cls(guard, namespace=namespace, replica=replica, ttl_s=ttl_s, owns_client=True)

    @property
    def _hash(self) -> bytes:
        return self._k.load_hash + self._replica

    # -- updates (never raise for Redis) ---------------------------------------------------

    async def incr(self, pod: str, inflight_delta: int, prefill_tokens_delta: int) -> None:
        """Add the deltas to this replica's counts for ``pod`` (clamped at 0), then wait
        -- at most the request deadline -- for the mirror to have them."""
        check_name("pod", pod)
        for name, v in (
            ("inflight_delta", inflight_delta),
            ("prefill_tokens_delta", prefill_tokens_delta),
        ):
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"{name} must be an int, got {v!r}")
        for table, delta in (
            (self._inflight, inflight_delta),
            (self._tokens, prefill_tokens_delta),
        ):
            if delta:
                v = table.get(pod, 0) + delta
                if v > 0:
                    table[pod] = v
                else:
                    table.pop(pod, None)
        self._dirty.add(pod)
        self._version += 1
        self._ensure_heartbeat()
        await self._publish()

    # router.fleet.load.LoadStore protocol
    async def begin(self, pod: str, prefill_tokens: int) -> None:
        await self.incr(pod, 1, prefill_tokens)

    async def prefill_done(self, pod: str, prefill_tokens: int) -> None:
        await self.incr(pod, 0, -prefill_tokens)

    async def end(self, pod: str) -> None:
        await self.incr(pod, -1, 0)

    async def clear_pod(self, pod: str) -> None:
        """Forget ``pod`` here and in every replica's mirror (pod gone); never raises for
        Redis (this replica's mirror is then republished when Redis is back)."""
        p = check_name("pod", pod)
        self._inflight.pop(pod, None)
        self._tokens.pop(pod, None)
        self._dirty.discard(pod)
        try:
            await self.guard.call(
                "load_clear",
                lambda: self._clear(keys=[self._k.load_replicas], args=[self._k.load_hash, p]),
                request=False,
            )
        except SharedStateUnavailable as exc:
            self._stale = True
            self.write_errors += 1
            log.debug("load store: clearing %s in Redis failed: %s", pod, exc)

    # -- reads -------------------------------------------------------------------------

    async def snapshot(self, pods: Iterable[str] | None = None) -> dict[str, tuple[int, int]]:
        """pod -> (in-flight, outstanding prefill tokens) summed over live replicas.

        With ``pods``, exactly those pods (0, 0 when unknown); else every pod with load.
        Raises :class:`SharedStateUnavailable` when Redis cannot answer in time."""
        flat = await self.guard.call(
            "load_snapshot",
            lambda: self._snap(keys=[self._k.load_replicas], args=[self._k.load_hash]),
            request=True,
        )
        seen = {
            flat[i].decode(): (int(flat[i + 1]), int(flat[i + 2])) for i in range(0, len(flat), 3)
        }
        if pods is None:
            return seen
        return {p: seen.get(p, (0, 0)) for p in pods}

    def local_snapshot(self, pods: Iterable[str] | None = None) -> dict[str, tuple[int, int]]:
        """This replica's own counts (the fallback while Redis is unavailable)."""
        inflight, tokens = self._inflight, self._tokens
        names = inflight.keys() | tokens.keys() if pods is None else pods
        return {p: (inflight.get(p, 0), tokens.get(p, 0)) for p in names}

    @property
    def stale(self) -> bool:
        """Whether the mirror in Redis may differ from this replica's counts."""
        return self._stale or bool(self._dirty) or self._publisher is not None

    # -- the mirror --------------------------------------------------------------------

    async def _publish(self) -> None:
        """Wait until the mirror has every change made so far, at most the request
        deadline; never raises (a failed write leaves the mirror stale)."""
        target = self._version
        self._kick()
        try:
            async with asyncio.timeout(self.guard.request_deadline_s):
                while self._published < target and self._publisher is not None:
                    await self._round.wait()
        except TimeoutError:
            pass  # the write goes on; the local counts are right meanwhile

    def _kick(self) -> None:
        """Start the publisher unless it runs, the store closes, or the breaker would
        refuse the write anyway (then the mirror is stale until it lets one through)."""
        if self._publisher is not None or self._closing:
            return
        breaker = self.guard.breaker
        if breaker.is_open and breaker.retry_in() > 0:
            self._stale = True
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._publisher = loop.create_task(self._publish_loop())

    async def _publish_loop(self) -> None:
        try:
            while (self._dirty or self._stale) and not self._closing:
                full = self._stale
                pods = self._inflight.keys() | self._tokens.keys() if full else self._dirty
                args: list[Any] = [self._replica, self._ttl_ms, b"1" if full else b"0"]
                for pod in sorted(pods):
                    args += [pod.encode(), self._inflight.get(pod, 0), self._tokens.get(pod, 0)]
                self._dirty = set()
                self._stale = False
                version = self._version
                try:
                    had = await self.guard.call(
                        "load_write",
                        partial(self._set, keys=[self._k.load_replicas, self._hash], args=args),
                        request=True,
                    )
                except SharedStateUnavailable as exc:
                    self._stale = True
                    self.write_errors += 1
                    log.debug("load store: writing the mirror failed: %s", exc)
                    return
                self._published = version
                if full:
                    self.republished += 1
                elif not int(had):
                    self._stale = True  # the hash was gone: the other pods must go too
                self._wake()
        finally:
            self._publisher = None
            self._wake()

    def _wake(self) -> None:
        done, self._round = self._round, asyncio.Event()
        done.set()

    def _breaker_state(self, state: str) -> None:
        if state == "closed" and (self._stale or self._dirty):
            self._kick()

    # -- heartbeat ---------------------------------------------------------------------

    async def heartbeat(self) -> None:
        """Refresh this replica's registration (the background task calls it); a mirror
        found lost or stale is republished.  Raises :class:`SharedStateUnavailable`."""
        had = await self.guard.call(
            "load_heartbeat",
            lambda: self._set(
                keys=[self._k.load_replicas, self._hash], args=[self._replica, self._ttl_ms, b"0"]
            ),
            request=False,
        )
        if not int(had):
            self._stale = True
        if self._stale or self._dirty:
            self._kick()

    def _ensure_heartbeat(self) -> None:
        if self._closing:
            return
        if self._heartbeat_task is None or self._heartbeat_task.done():
            self._heartbeat_task = asyncio.get_running_loop().create_task(self._beat())

    async def _beat(self) -> None:
        period = self.ttl_s / 3
        while True:
            await asyncio.sleep(period)
            try:
                await self.heartbeat()
            except SharedStateUnavailable as exc:
                raise_if_cancelled(exc)
                self.heartbeat_errors += 1
                level = logging.DEBUG if exc.kind == "open" else logging.WARNING
                log.log(level, "load store heartbeat of replica %s failed: %s", self.replica, exc)
            raise_if_cancelled()

    async def close(self) -> None:
        """Stop heartbeating and withdraw this replica's counts at once."""
        self._closing = True
        self._unlisten()
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat_task
            self._heartbeat_task = None
        if self._publisher is not None:  # its write is bounded by the request deadline
            with contextlib.suppress(Exception):
                await self._publisher

        async def withdraw() -> None:
            async with self._r.pipeline(transaction=True) as pipe:
                pipe.zrem(self._k.load_replicas, self._replica)
                pipe.delete(self._hash)
                await pipe.execute()

        with contextlib.suppress(SharedStateUnavailable):
            await self.guard.call("load_withdraw", withdraw, request=True)
        if self._owns:
            await self.guard.aclose()
