"""Redis / Valkey backends shared by several router replicas: the block index and the load view.

:class:`RedisIndex` implements :class:`~scoring.index.base.BlockIndex` (same semantics as
the in-memory index; the shared behaviour suite holds both to them):

* one server round trip per ``lookup`` (a Lua script walks the chain server-side and
  stops at the first block no remaining candidate holds), per ``add`` / ``remove``
  batch (a script; batches above ``batch_keys`` go as several scripts in one pipeline)
  and per ``clear_pod``;
* counted (pod, key, tier) entries: ``add`` increments, ``remove`` decrements, the entry
  is deleted at 0;
* each (pod, tier) has a *slot id* -- its generation -- and a hash of its blocks; a
  block has a *holder hint*, the sorted ids of the slots holding it.  ``clear_pod``
  never scans: it retires the slot id (entries invisible at once) and UNLINKs the
  slot's hash; :meth:`RedisIndex.sweep` later drops retired ids from the hints;
* a slot that receives no ``add`` for ``ttl_s`` is ignored by lookups and expires soon
  after, so nothing outlives a pod that vanished without a ``clear_pod``;
* block keys are unsigned 64-bit ints, stored as 8 raw big-endian bytes.

Key layout and cluster placement: see :mod:`scoring.index.redis_lua` and docs/redis.md.

:class:`RedisLoadStore` is the shared twin of ``router.fleet.load.MemoryLoadStore``: per-replica
counters (a hash per replica, with a heartbeat and a TTL) summed at snapshot time, so a
crashed replica's in-flight requests vanish from everyone's view after ``ttl_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import uuid
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

from scoring.index import redis_lua
from scoring.index.base import DEFAULT_TIERS, PodHits

__all__ = ["RedisIndex", "RedisLoadStore", "pack_keys"]

log = logging.getLogger(__name__)

_U64 = (1 << 64) - 1


def _check_name(what: str, value: str) -> bytes:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string, got {value!r}")
    if "\0" in value:
        raise ValueError(f"{what} must not contain NUL characters, got {value!r}")
    return value.encode()


def pack_keys(keys: Sequence[int]) -> bytes:
    """Block keys -> 8 big-endian bytes each; ValueError naming the bad key otherwise."""
    try:
        return struct.pack(f">{len(keys)}Q", *keys)
    except (struct.error, TypeError):
        for i, k in enumerate(keys):
            if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= _U64:
                raise ValueError(
                    f"block key #{i} must be an unsigned 64-bit int, got {k!r}"
                ) from None
        raise


#: one script call: (script, KEYS, ARGV)
_Call = tuple[AsyncScript, list[bytes], list[Any]]


class _Layout:
    """Key names of one namespace, all sharing the hash tag ``{namespace}``."""

    def __init__(self, namespace: str) -> None:
        raw = _check_name("namespace", namespace)
        if b"{" in raw or b"}" in raw:
            raise ValueError(f"namespace must not contain braces, got {namespace!r}")
        self.prefix = b"{" + raw + b"}:"
        self.hints = self.prefix + b"h"  # HASH block key -> holder hint
        self.digests = self.prefix + b"d"  # HASH block key -> digest of its hint
        self.pods = self.prefix + b"p:"  # + tier: pod -> slot id
        self.ids = self.prefix + b"ids"
        self.next = self.prefix + b"next"
        self.seen = self.prefix + b"seen"
        self.load_replicas = self.prefix + b"load:r"
        self.load_hash = self.prefix + b"load:h:"
        self.writer = self.prefix + b"writer"  # STRING: the writer lease's holder


class RedisIndex:
    """:class:`~scoring.index.base.BlockIndex` stored in Redis >= 7 / Valkey >= 8.

    Parameters: ``client`` -- a ``redis.asyncio.Redis`` with ``decode_responses=False``;
    ``namespace`` -- isolates indexes sharing one server (one per model is the natural
    cluster shard, see docs/redis.md); ``tiers`` -- fastest first, identical on every
    replica; ``ttl_s`` -- a (pod, tier) that stores nothing for ``ttl_s`` seconds is
    ignored by lookups at once and its slot hash expires ``SLOT_GRACE_S`` later
    (``None``/0 disables: then only ``clear_pod`` forgets a pod); ``sweep`` removes the
    holder hints of retired and stale slots;
    ``batch_keys`` -- keys per script call (bounds how long one call blocks the server).
    """

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        namespace: str = "kvroute",
        tiers: Sequence[str] = DEFAULT_TIERS,
        ttl_s: int | None = 86_400,
        batch_keys: int = 4096,
        owns_client: bool = False,
    ) -> None:
        if not tiers:
            raise ValueError("tiers must name at least one tier")
        for t in tiers:
            _check_name("tier", t)
        if len(set(tiers)) != len(tiers):
            raise ValueError(f"tiers must be distinct, got {list(tiers)!r}")
        if ttl_s is not None and (not isinstance(ttl_s, int) or ttl_s < 0):
            raise ValueError(f"ttl_s must be a non-negative int or None, got {ttl_s!r}")
        if batch_keys <= 0:
            raise ValueError(f"batch_keys must be positive, got {batch_keys!r}")
        self.tiers: tuple[str, ...] = tuple(tiers)
        self.namespace = namespace
        self.ttl_s = ttl_s or 0
        self._ttl_arg = str(self.ttl_s).encode()
        self.batch_keys = batch_keys
        self._k = _Layout(namespace)
        self._r = client
        self._owns = owns_client
        self._tier_keys = {t: self._k.pods + t.encode() for t in self.tiers}
        self._add: AsyncScript = client.register_script(redis_lua.ADD)
        self._remove: AsyncScript = client.register_script(redis_lua.REMOVE)
        self._clear: AsyncScript = client.register_script(redis_lua.CLEAR)
        self._lookup: AsyncScript = client.register_script(redis_lua.LOOKUP)
        self._entries: AsyncScript = client.register_script(redis_lua.POD_ENTRIES)
        self._sweep: AsyncScript = client.register_script(redis_lua.SWEEP)
        self._claim_writer: AsyncScript = client.register_script(redis_lua.CLAIM_WRITER)
        self._release_writer: AsyncScript = client.register_script(redis_lua.RELEASE_WRITER)
        #: hint entries removed by :meth:`sweep_forever`, and sweeps that failed
        self.swept = 0
        self.sweep_errors = 0

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        namespace: str = "kvroute",
        tiers: Sequence[str] = DEFAULT_TIERS,
        ttl_s: int | None = 86_400,
        batch_keys: int = 4096,
        **client_kwargs: Any,
    ) -> RedisIndex:
        """An index owning a new client for ``url`` (closed by :meth:`close`)."""
        client = aioredis.Redis.from_url(url, decode_responses=False, **client_kwargs)
        return cls(
            client,
            namespace=namespace,
            tiers=tiers,
            ttl_s=ttl_s,
            batch_keys=batch_keys,
            owns_client=True,
        )

    # -- BlockIndex --------------------------------------------------------------------

    def _tier(self, tier: str) -> bytes:
        if tier not in self.tiers:
            raise ValueError(f"unknown tier {tier!r}; this index has tiers {list(self.tiers)}")
        return tier.encode()

    def _chunks(self, keys: Sequence[int]) -> list[bytes]:
        n = self.batch_keys
        return [pack_keys(keys[i : i + n]) for i in range(0, len(keys), n)]

    async def _run_calls(self, calls: list[_Call]) -> None:
        """Run script calls in order: one call, or one pipeline (still one round trip).

        A call refused with NOSCRIPT (the server restarted or flushed its script cache)
        is retried, in order, after SCRIPT LOAD; calls that ran are never re-run.
        """
        if len(calls) == 1:
            script, keys, args = calls[0]
            await script(keys=keys, args=args)
            return
        todo = calls
        for _attempt in range(2):
            async with self._r.pipeline(transaction=False) as pipe:
                for script, keys, args in todo:
                    pipe.evalsha(script.sha, len(keys), *keys, *args)
                results = await pipe.execute(raise_on_error=False)
            errors = [r for r in results if isinstance(r, Exception)]
            if not errors:
                return
            other = [e for e in errors if not isinstance(e, NoScriptError)]
            if other:
                raise other[0]
            failed = [c for c, r in zip(todo, results, strict=True) if isinstance(r, Exception)]
            for script in {id(c[0]): c[0] for c in failed}.values():
                await self._r.script_load(script.script)
            todo = failed
        raise RuntimeError("script missing on the server even after SCRIPT LOAD")

    def _add_calls(self, pod: str, keys: Sequence[int], tier: str) -> list[_Call]:
        p = _check_name("pod", pod)
        t = self._tier(tier)
        k = self._k
        skeys = [self._tier_keys[tier], k.ids, k.next, k.seen, k.hints, k.digests]
        return [(self._add, skeys, [k.prefix, p, t, self._ttl_arg, c]) for c in self._chunks(keys)]

    def _remove_calls(self, pod: str, keys: Sequence[int], tier: str) -> list[_Call]:
        p = _check_name("pod", pod)
        t = self._tier(tier)
        k = self._k
        tk = [self._tier_keys[tier], k.hints, k.digests]
        return [(self._remove, tk, [k.prefix, p, t, c]) for c in self._chunks(keys)]

    def _clear_calls(self, pod: str, tier: str | None) -> list[_Call]:
        p = _check_name("pod", pod)
        if tier is None:
            tiers = list(self._tier_keys.values())
        else:
            self._tier(tier)
            tiers = [self._tier_keys[tier]]
        k = self._k
        return [(self._clear, [k.ids, k.seen, *tiers], [k.prefix, p])]

    async def add(self, pod: str, keys: Sequence[int], tier: str = "GPU") -> None:
        """Count one more copy of each key on ``pod`` in ``tier`` (refreshes the TTL)."""
        calls = self._add_calls(pod, keys, tier)
        if calls:
            await self._run_calls(calls)

    async def remove(self, pod: str, keys: Sequence[int], tier: str = "GPU") -> None:
        """Count one copy fewer of each key; entries at 0 are deleted, unknown keys ignored."""
        calls = self._remove_calls(pod, keys, tier)
        if calls:
            await self._run_calls(calls)

    async def clear_pod(self, pod: str, tier: str | None = None) -> None:
        """Retire the pod's slot ids (all tiers, or ``tier``): O(tiers), no keyspace scan."""
        await self._run_calls(self._clear_calls(pod, tier))

    async def apply_ops(self, ops: Iterable[tuple[str, str, str | None, Sequence[int]]]) -> None:
        """Several writes, in order, in one round trip (an extension beyond BlockIndex).

        ``ops`` are ``(kind, pod, tier, keys)`` with kind ``"add"`` / ``"remove"`` (tier
        required) or ``"clear"`` (tier None = all tiers; keys ignored) -- the shape of
        ``scoring.events.apply.IndexOps.ops``.  Every op is validated before anything
        is sent, so a bad op (ValueError naming it) leaves the index untouched.
        """
        calls: list[_Call] = []
        for n, (kind, pod, tier, keys) in enumerate(ops):
            if kind == "clear":
                calls.extend(self._clear_calls(pod, tier))
            elif kind in ("add", "remove"):
                if tier is None:
                    raise ValueError(f"op #{n} ({kind} on {pod!r}) needs a tier")
                make = self._add_calls if kind == "add" else self._remove_calls
                calls.extend(make(pod, keys, tier))
            else:
                raise ValueError(f"op #{n} has unknown kind {kind!r}; use add, remove or clear")
        if calls:
            await self._run_calls(calls)

    async def lookup(
        self, keys: Sequence[int], pods: Collection[str] | None = None
    ) -> dict[str, PodHits]:
        """Per pod holding block 0: leading blocks servable per tier (cumulative), one trip."""
        if not keys:
            return {}
        packed = pack_keys(keys)
        args: list[Any] = [self._k.prefix, packed, self._ttl_arg]
        if pods is not None:
            cands = sorted({_check_name("pod", p) for p in pods})
            if not cands:
                return {}
            args.extend(cands)
        k = self._k
        keys_ = [k.ids, k.seen, k.hints, k.digests, *self._tier_keys.values()]
        reply = await self._lookup(keys=keys_, args=args)
        if not reply:
            return {}
        names = reply[0].decode().split("\0")
        rows = reply[1].split(b";")
        tiers = self.tiers
        # many pods share a row (a system prompt every pod holds): parse each row once
        parsed: dict[bytes, PodHits] = {}
        out: dict[str, PodHits] = {}
        for name, row in zip(names, rows, strict=True):
            hits = parsed.get(row)
            if hits is None:
                hits = parsed[row] = dict(zip(tiers, map(int, row.split(b",")), strict=True))
            out[name] = hits.copy()
        return out

    async def pod_entries(self) -> dict[str, int]:
        """Distinct (key, tier) entries per pod (HLEN of its live slots; exact)."""
        k = self._k
        flat = await self._entries(keys=[k.ids, k.seen], args=[k.prefix, self._ttl_arg])
        return {flat[i].decode(): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    async def close(self) -> None:
        """Close the client if this index created it (:meth:`from_url`)."""
        if self._owns:
            await self._r.aclose()

    # -- the writer lease ----------------------------------------------------------------

    async def claim_writer(self, holder: str, lease_s: float) -> str | None:
        """Take or renew this namespace's writer lease for ``holder`` (it expires
        ``lease_s`` after the last claim); None when ``holder`` holds it, else whoever
        does.  One process should apply KV events to a namespace: two apply every event
        twice and each one's resync clears the pod under the other's bookkeeping."""
        cur = await self._claim_writer(keys=[self._k.writer], args=[holder, int(lease_s * 1000)])
        return None if cur is None else (cur.decode() if isinstance(cur, bytes) else str(cur))

    async def writer(self) -> str | None:
        """Who holds the writer lease now (None: nobody)."""
        cur = await self._r.get(self._k.writer)
        return None if cur is None else (cur.decode() if isinstance(cur, bytes) else str(cur))

    async def release_writer(self, holder: str) -> None:
        """Give the writer lease up if ``holder`` holds it."""
        await self._release_writer(keys=[self._k.writer], args=[holder])

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
            cursor, found = await self._r.hscan(k.hints, cursor=cursor, count=count)
            page = list(found)
            if page:
                removed += int(
                    await self._sweep(
                        keys=[k.ids, k.seen, k.hints, k.digests],
                        args=[k.prefix, self._ttl_arg, *page],
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
            except (aioredis.RedisError, OSError) as exc:
                _raise_if_cancelled(exc)
                self.sweep_errors += 1
                log.warning("sweep of redis index %r failed: %s", self.namespace, exc)
            _raise_if_cancelled()

    async def block_keys(self) -> int:
        """Number of distinct blocks held by any slot in this namespace (hint fields)."""
        return int(await self._r.hlen(self._k.hints))


def _raise_if_cancelled(cause: BaseException | None = None) -> None:
    """Raise ``CancelledError`` when the current task was asked to stop.

    redis-py can swallow a ``CancelledError`` delivered while a command is in flight
    (the command then returns, or fails with a connection error), so a background loop
    that must end when cancelled checks this after every call; otherwise
    ``task.cancel(); await task`` would wait forever.
    """
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)  # Python >= 3.11
    if cancelling is not None and cancelling() > 0:
        raise asyncio.CancelledError() from cause


class RedisLoadStore:
    """Router-tracked load shared by all replicas (the ``router.fleet.load.LoadStore`` protocol).

    Each replica keeps its own counters in one hash (``{ns}:load:h:<replica>``), fields
    ``i NUL pod`` (in-flight requests) and ``t NUL pod`` (outstanding prefill tokens),
    clamped at 0 like the in-memory store.  A replica registers in a sorted set with
    an expiry ``now + ttl_s`` (server clock), refreshed by every update and by a
    heartbeat every ``ttl_s / 3``.  ``snapshot`` sums the hashes of replicas whose
    expiry is in the future, so a crashed replica's contribution disappears after at
    most ``ttl_s``.  Every operation is one round trip.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        namespace: str = "kvroute",
        replica: str | None = None,
        ttl_s: float = 15.0,
        owns_client: bool = False,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be positive, got {ttl_s!r}")
        self.replica = replica or uuid.uuid4().hex
        self._replica = _check_name("replica", self.replica)
        self._k = _Layout(namespace)
        self.ttl_s = ttl_s
        self._ttl_ms = str(max(1, int(ttl_s * 1000))).encode()
        self._r = client
        self._owns = owns_client
        self._incr: AsyncScript = client.register_script(redis_lua.LOAD_INCR)
        self._snap: AsyncScript = client.register_script(redis_lua.LOAD_SNAPSHOT)
        self._clear: AsyncScript = client.register_script(redis_lua.LOAD_CLEAR_POD)
        self._heartbeat_task: asyncio.Task[None] | None = None
        #: heartbeats that failed (the loop keeps going; exported by the router)
        self.heartbeat_errors = 0

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        namespace: str = "kvroute",
        replica: str | None = None,
        ttl_s: float = 15.0,
        **client_kwargs: Any,
    ) -> RedisLoadStore:
        client = aioredis.Redis.from_url(url, decode_responses=False, **client_kwargs)
        return cls(client, namespace=namespace, replica=replica, ttl_s=ttl_s, owns_client=True)

    @property
    def _hash(self) -> bytes:
        return self._k.load_hash + self._replica

    async def incr(self, pod: str, inflight_delta: int, prefill_tokens_delta: int) -> None:
        """Add the deltas to this replica's counters for ``pod`` (and heartbeat)."""
        p = _check_name("pod", pod)
        for name, v in (
            ("inflight_delta", inflight_delta),
            ("prefill_tokens_delta", prefill_tokens_delta),
        ):
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"{name} must be an int, got {v!r}")
        self._ensure_heartbeat()
        await self._incr(
            keys=[self._k.load_replicas, self._hash],
            args=[self._replica, self._ttl_ms, p, inflight_delta, prefill_tokens_delta],
        )

    async def heartbeat(self) -> None:
        """Refresh this replica's registration (the background task calls it)."""
        await self._incr(
            keys=[self._k.load_replicas, self._hash], args=[self._replica, self._ttl_ms]
        )

    # router.fleet.load.LoadStore protocol
    async def begin(self, pod: str, prefill_tokens: int) -> None:
        await self.incr(pod, 1, prefill_tokens)

    async def prefill_done(self, pod: str, prefill_tokens: int) -> None:
        await self.incr(pod, 0, -prefill_tokens)

    async def end(self, pod: str) -> None:
        await self.incr(pod, -1, 0)

    async def snapshot(self, pods: Iterable[str] | None = None) -> dict[str, tuple[int, int]]:
        """pod -> (in-flight, outstanding prefill tokens) summed over live replicas.

        With ``pods``, exactly those pods (0, 0 when unknown); else every pod with load.
        """
        flat = await self._snap(keys=[self._k.load_replicas], args=[self._k.load_hash])
        seen = {
            flat[i].decode(): (int(flat[i + 1]), int(flat[i + 2])) for i in range(0, len(flat), 3)
        }
        if pods is None:
            return seen
        return {p: seen.get(p, (0, 0)) for p in pods}

    async def clear_pod(self, pod: str) -> None:
        """Forget ``pod`` in every replica's counters (pod gone)."""
        p = _check_name("pod", pod)
        await self._clear(keys=[self._k.load_replicas], args=[self._k.load_hash, p])

    def _ensure_heartbeat(self) -> None:
        if self._heartbeat_task is None or self._heartbeat_task.done():
            self._heartbeat_task = asyncio.get_running_loop().create_task(self._beat())

    async def _beat(self) -> None:
        period = self.ttl_s / 3
        while True:
            await asyncio.sleep(period)
            try:
                await self.heartbeat()
            except (aioredis.RedisError, OSError) as exc:
                _raise_if_cancelled(exc)
                self.heartbeat_errors += 1
                log.warning("load store heartbeat of replica %s failed: %s", self.replica, exc)
            _raise_if_cancelled()

    async def close(self) -> None:
        """Stop heartbeating and withdraw this replica's counters at once."""
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat_task
            self._heartbeat_task = None
        with contextlib.suppress(aioredis.RedisError, OSError):
            async with self._r.pipeline(transaction=True) as pipe:
                pipe.zrem(self._k.load_replicas, self._replica)
                pipe.delete(self._hash)
                await pipe.execute()
        if self._owns:
            await self._r.aclose()
