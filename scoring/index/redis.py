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

Every call goes through a :class:`~scoring.index.redis_guard.RedisGuard` (one per Redis
URL of a process, shared by its stores): a ``lookup`` has the short request deadline
and raises :class:`~scoring.index.breaker.SharedStateUnavailable` on any failure; the
writes (``add`` / ``remove`` / ``clear_pod`` / ``apply_ops``) have the longer background
deadline per batch, are never resent, and raise ``SharedStateUnavailable`` when the
server is unreachable, hung or the breaker is open, or the server's own error reply
(READONLY, OOM) as before -- the KV-event subscriber resyncs the pod either way.

:meth:`RedisIndex.ensure_epoch` / :meth:`RedisIndex.epoch`: the namespace's *epoch*, a
random id the writer creates when it finds none; a missing or different epoch tells the
writer that Redis lost the index (a restart without persistence, a flush) and every pod
must be learned again.

:class:`~scoring.index.redis_load.RedisLoadStore` (re-exported here) is the shared load
view.  Script calls are sent by :mod:`scoring.index.redis_calls`; the lease, the sweep
and the epoch are :class:`~scoring.index.redis_upkeep.IndexUpkeep`, the base class of
:class:`RedisIndex`.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript

from scoring.index import redis_lua
from scoring.index.base import DEFAULT_TIERS, PodHits
from scoring.index.breaker import CircuitBreaker, SharedStateUnavailable
from scoring.index.redis_calls import Call, pack_keys, run_calls
from scoring.index.redis_guard import BACKGROUND_DEADLINE_S, REQUEST_DEADLINE_S, RedisGuard
from scoring.index.redis_keys import Layout, check_name
from scoring.index.redis_load import RedisLoadStore
from scoring.index.redis_upkeep import IndexUpkeep

__all__ = ["RedisGuard", "RedisIndex", "RedisLoadStore", "SharedStateUnavailable", "pack_keys"]


class RedisIndex(IndexUpkeep):
    """:class:`~scoring.index.base.BlockIndex` stored in Redis >= 7 / Valkey >= 8.

    Parameters: ``client`` -- a :class:`~scoring.index.redis_guard.RedisGuard` (shared
    with the process's other stores on that URL), or a ``redis.asyncio.Redis`` with
    ``decode_responses=False`` (then wrapped in a guard of its own); ``namespace`` --
    isolates indexes sharing one server (one per model is the natural cluster shard,
    see docs/redis.md); ``tiers`` -- fastest first, identical on every
    replica; ``ttl_s`` -- a (pod, tier) that stores nothing for ``ttl_s`` seconds is
    ignored by lookups at once and its slot hash expires ``SLOT_GRACE_S`` later
    (``None``/0 disables: then only ``clear_pod`` forgets a pod); ``sweep`` removes the
    holder hints of retired and stale slots;
    ``batch_keys`` -- keys per script call (bounds how long one call blocks the server);
    ``owns_client`` -- :meth:`close` closes the client (or the guard).
    """

    def __init__(
        self,
        client: aioredis.Redis | RedisGuard,
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
            check_name("tier", t)
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
        self._k = Layout(namespace)
        self.guard = (
            client
            if isinstance(client, RedisGuard)
            else RedisGuard(client, owns_client=owns_client)
        )
        self._r = client = self.guard.client
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
        breaker: CircuitBreaker | None = None,
        request_deadline_s: float = REQUEST_DEADLINE_S,
        background_deadline_s: float = BACKGROUND_DEADLINE_S,
        **client_kwargs: Any,
    ) -> RedisIndex:
        """An index owning a new guarded client for ``url`` (closed by :meth:`close`).

        Stores of one process should rather share one :class:`RedisGuard` (one pool,
        one breaker): ``RedisIndex(guard, ...)``."""
        guard = RedisGuard.from_url(
            url,
            breaker=breaker,
            request_deadline_s=request_deadline_s,
            background_deadline_s=background_deadline_s,
            **client_kwargs,
        )
        return cls(
            guard,
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

    async def _write(self, op: str, calls: list[Call], *, idempotent: bool = False) -> None:
        """:func:`~scoring.index.redis_calls.run_calls` under the guard: the background
        deadline for the batch, never resent unless ``idempotent``, error replies raised as
        they are."""
        await self.guard.call(
            op,
            lambda: run_calls(self._r, calls),
            request=False,
            idempotent=idempotent,
            wrap_errors=False,
        )

    def _add_calls(self, pod: str, keys: Sequence[int], tier: str) -> list[Call]:
        p = check_name("pod", pod)
        t = self._tier(tier)
        k = self._k
        skeys = [self._tier_keys[tier], k.ids, k.next, k.seen, k.hints, k.digests]
        return [(self._add, skeys, [k.prefix, p, t, self._ttl_arg, c]) for c in self._chunks(keys)]

    def _remove_calls(self, pod: str, keys: Sequence[int], tier: str) -> list[Call]:
        p = check_name("pod", pod)
        t = self._tier(tier)
        k = self._k
        tk = [self._tier_keys[tier], k.hints, k.digests]
        return [(self._remove, tk, [k.prefix, p, t, c]) for c in self._chunks(keys)]

    def _clear_calls(self, pod: str, tier: str | None) -> list[Call]:
        p = check_name("pod", pod)
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
            await self._write("index_add", calls)

    async def remove(self, pod: str, keys: Sequence[int], tier: str = "GPU") -> None:
        """Count one copy fewer of each key; entries at 0 are deleted, unknown keys ignored."""
        calls = self._remove_calls(pod, keys, tier)
        if calls:
            await self._write("index_remove", calls)

    async def clear_pod(self, pod: str, tier: str | None = None) -> None:
        """Retire the pod's slot ids (all tiers, or ``tier``): O(tiers), no keyspace scan."""
        await self._write("index_clear", self._clear_calls(pod, tier), idempotent=True)

    async def apply_ops(self, ops: Iterable[tuple[str, str, str | None, Sequence[int]]]) -> None:
        """Several writes, in order, in one round trip (an extension beyond BlockIndex).

        ``ops`` are ``(kind, pod, tier, keys)`` with kind ``"add"`` / ``"remove"`` (tier
        required) or ``"clear"`` (tier None = all tiers; keys ignored) -- the shape of
        ``scoring.events.apply.IndexOps.ops``.  Every op is validated before anything
        is sent, so a bad op (ValueError naming it) leaves the index untouched.
        """
        calls: list[Call] = []
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
            await self._write("index_apply", calls)

    async def lookup(
        self, keys: Sequence[int], pods: Collection[str] | None = None
    ) -> dict[str, PodHits]:
        """Per pod holding block 0: leading blocks servable per tier (cumulative), one trip.

        Raises :class:`SharedStateUnavailable` when Redis does not answer within the
        request deadline, fails, or the breaker is open."""
        if not keys:
            return {}
        packed = pack_keys(keys)
        args: list[Any] = [self._k.prefix, packed, self._ttl_arg]
        if pods is not None:
            cands = sorted({check_name("pod", p) for p in pods})
            if not cands:
                return {}
            args.extend(cands)
        k = self._k
        keys_ = [k.ids, k.seen, k.hints, k.digests, *self._tier_keys.values()]
        reply = await self.guard.call(
            "lookup", lambda: self._lookup(keys=keys_, args=args), request=True
        )
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
        flat = await self._background(
            "pod_entries",
            lambda: self._entries(keys=[k.ids, k.seen], args=[k.prefix, self._ttl_arg]),
        )
        return {flat[i].decode(): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    async def close(self) -> None:
        """Close the client if this index owns it (:meth:`from_url`, ``owns_client``)."""
        if self._owns:
            await self.guard.aclose()
