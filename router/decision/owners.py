"""Who owns a stored response: ``response id -> (pod, tenant)``, in memory (LRU with
TTL) or in Redis under ``{ns}:resp:{id}`` so every replica sees it.

vLLM keeps stored responses in the memory of the pod that created them, so a follow-up
(``previous_response_id``), ``GET`` and ``cancel`` of an id only work there.

With tenants, a response belongs to the tenant that created it as well: ``get`` with
another tenant finds nothing, exactly as for an id never seen (the callers answer the
same 404), so a tenant cannot even learn that an id exists.  In Redis the value is the
pod, or ``pod NUL tenant``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Protocol


class OwnerStore(Protocol):
    """``response id -> pod`` for the pods' stored responses."""

    async def get(self, response_id: str, tenant: str | None = None) -> str | None:
        """The pod of ``response_id`` if ``tenant`` created it (None: unknown, or not
        ``tenant``'s)."""
        ...

    async def put(self, response_id: str, pod: str, tenant: str | None = None) -> None: ...

    async def close(self) -> None: ...


class MemoryOwnerStore:
    """This replica's owners: a bounded LRU, each entry kept ``ttl_s`` after it was
    recorded (a replica that did not create a response does not know its owner: use
    Redis with several replicas)."""

    def __init__(self, max_owners: int, ttl_s: float) -> None:
        self.max_owners = max_owners
        self.ttl_s = ttl_s
        self._owners: OrderedDict[str, tuple[str, str | None, float]] = OrderedDict()

    async def get(self, response_id: str, tenant: str | None = None) -> str | None:
        entry = self._owners.get(response_id)
        if entry is None:
            return None
        pod, owner, expires = entry
        if time.monotonic() >= expires:
            del self._owners[response_id]
            return None
        if owner != tenant:
            return None
        self._owners.move_to_end(response_id)
        return pod

    async def put(self, response_id: str, pod: str, tenant: str | None = None) -> None:
        owners = self._owners
        owners[response_id] = (pod, tenant, time.monotonic() + self.ttl_s)
        owners.move_to_end(response_id)
        while len(owners) > self.max_owners:
            owners.popitem(last=False)

    def __len__(self) -> int:
        return len(self._owners)

    async def close(self) -> None:
        self._owners.clear()


class RedisOwnerStore:
    """Owners shared by every replica: ``{namespace}:resp:{id}`` -> pod, expiring
    ``ttl_s`` after it was recorded.

    ``client`` -- a ``scoring.index.redis_guard.RedisGuard`` shared with the process's
    other stores on that Redis (one pool, one breaker), or a ``redis.asyncio.Redis``
    (wrapped in a guard of its own).  ``get`` and ``put`` have the guard's request
    deadline and raise ``scoring.index.breaker.SharedStateUnavailable`` on any Redis
    failure, or at once while the breaker is open."""

    def __init__(self, client: Any, namespace: str, ttl_s: float, *, owns_client: bool) -> None:
        from scoring.index.redis_guard import RedisGuard

        self.guard = (
            client
            if isinstance(client, RedisGuard)
            else RedisGuard(client, owns_client=owns_client)
        )
        self._r = self.guard.client
        self._prefix = f"{namespace}:resp:"
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._owns = owns_client

    @classmethod
    def from_url(
        cls, url: str, namespace: str, ttl_s: float, **guard_kwargs: Any
    ) -> RedisOwnerStore:
        """A store owning a new guarded client (``guard_kwargs``: ``breaker``, the
        deadlines, client options -- see ``RedisGuard.from_url``)."""
        from scoring.index.redis_guard import RedisGuard

        return cls(RedisGuard.from_url(url, **guard_kwargs), namespace, ttl_s, owns_client=True)

    def key(self, response_id: str) -> str:
        return self._prefix + response_id

    async def get(self, response_id: str, tenant: str | None = None) -> str | None:
        key = self._prefix + response_id
        value = await self.guard.call("owner_get", lambda: self._r.get(key), request=True)
        if value is None:
            return None
        text = value.decode() if isinstance(value, bytes) else str(value)
        pod, sep, owner = text.partition("\x00")
        if (owner if sep else None) != tenant:
            return None
        return pod

    async def put(self, response_id: str, pod: str, tenant: str | None = None) -> None:
        key = self._prefix + response_id
        value = (pod if tenant is None else f"{pod}\x00{tenant}").encode()
        await self.guard.call(
            "owner_put", lambda: self._r.set(key, value, px=self._ttl_ms), request=True
        )

    async def close(self) -> None:
        if self._owns:
            await self.guard.aclose()
