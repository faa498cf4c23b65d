"""Per-tenant rate limits: token buckets for requests and for tokens per minute.

Each limited tenant has up to two buckets, ``requests`` and ``tokens``.  A bucket holds
at most one minute's worth (``capacity`` = the per-minute limit) and refills
continuously at ``limit / 60`` per second; a full bucket therefore lets a burst of one
minute's worth through at once, and over any long stretch the rate is the limit.

* ``requests``: each request needs 1 and takes 1.
* ``tokens``: a request needs its prompt tokens (or a full bucket, for a prompt larger
  than the bucket) and takes them on admission; the completion tokens of its answer
  (the pod's ``usage``; for a stream whose client did not ask for it, the usage the
  router asked for, :mod:`router.proxy.hidden_usage`) are taken when the answer ends,
  without a check: the bucket may go below zero, and the tenant's next requests wait
  until it refilled.

A refused request gets 429 with ``Retry-After`` (whole seconds until the bucket holds
what it needs).

With ``redis_url`` the buckets live in Redis (``{ns}:tl:{tenant}:{bucket}``, a hash of
level and time), updated by one Lua script that reads the server's clock (``TIME``), so
every replica draws from the same bucket and no replica's clock matters.  The call has
the guard's request deadline; when Redis fails (or the breaker is open) the replica
uses a local bucket of its own (degraded: each replica then admits up to the full limit,
so N replicas admit up to N times the limit until Redis is back; counted in
``kvroute_tenant_limit_degraded_total``).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from router.errors import RouterError
from router.logs import RateLimitedLog
from router.tenants.settings import Tenant
from scoring.index.breaker import SharedStateUnavailable

log = logging.getLogger(__name__)

#: KEYS[1] the bucket; ARGV capacity, refill per second, cost, need (< 0: take without a
#: check), ttl ms.  Returns {1, 0} (taken) or {0, ms until the bucket holds need}.
BUCKET_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cap = tonumber(ARGV[1])
local rate = tonumber(ARGV[2]) / 1000
local cost = tonumber(ARGV[3])
local need = tonumber(ARGV[4])
local v = redis.call('HMGET', KEYS[1], 'l', 't')
local level = tonumber(v[1])
local ts = tonumber(v[2])
if level == nil or ts == nil then
  level = cap
  ts = now
end
level = math.min(cap, level + math.max(0, now - ts) * rate)
local ok = 1
local wait = 0
if need >= 0 and level < need then
  ok = 0
  wait = math.ceil((need - level) / rate)
else
  level = level - cost
end
redis.call('HSET', KEYS[1], 'l', tostring(level), 't', tostring(now))
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return {ok, wait}
"""


@dataclass
class _Bucket:
    level: float
    at: float


class LocalBuckets:
    """The same buckets in this process (no Redis, or Redis down)."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self._clock = clock
        self._buckets: dict[str, _Bucket] = {}

    def take(self, key: str, capacity: float, cost: float, need: float) -> float:
        """0 when taken, else seconds until the bucket holds ``need``."""
        now = self._clock()
        rate = capacity / 60.0
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = _Bucket(capacity, now)
        b.level = min(capacity, b.level + max(0.0, now - b.at) * rate)
        b.at = now
        if need >= 0 and b.level < need:
            return (need - b.level) / rate
        b.level -= cost
        return 0.0


class RedisBuckets:
    """The buckets in Redis, shared by every replica (one script call per take)."""

    def __init__(self, guard: Any, namespace: str) -> None:
        self.guard = guard
        self._script = guard.client.register_script(BUCKET_LUA)
        self._prefix = f"{namespace}:tl:"

    async def take(self, key: str, capacity: float, cost: float, need: float) -> float:
        args = [repr(capacity), repr(capacity / 60.0), repr(cost), repr(need), 120_000]
        rkey = self._prefix + key

        async def run() -> Any:
            return await self._script(keys=[rkey], args=args)

        ok, wait_ms = await self.guard.call("tenant_limit", run, request=True, idempotent=False)
        return 0.0 if int(ok) == 1 else max(int(wait_ms), 1) / 1000.0


#: the buckets of kvroute_ttft_seconds (router/metrics.py), so the two compare
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class TenantMetrics:
    """``kvroute_tenant_requests_total{tenant,status}``, ``kvroute_tenant_limited_total
    {tenant,limit}``, ``kvroute_tenant_tokens_total{tenant,kind}``,
    ``kvroute_tenant_ttft_seconds{tenant}``, ``kvroute_tenant_limit_degraded_total``.
    The tenant label takes the configured names (and ``unauthenticated``): bounded."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "kvroute_tenant_requests",
            "Requests per tenant by final status (tenant 'unauthenticated': no valid key)",
            ["tenant", "status"],
            registry=registry,
        )
        self.limited = Counter(
            "kvroute_tenant_limited",
            "Requests refused with 429 per tenant, by the limit that refused them",
            ["tenant", "limit"],
            registry=registry,
        )
        self.tokens = Counter(
            "kvroute_tenant_tokens",
            "Tokens per tenant: kind prompt (admitted requests' prompts, as the router "
            "tokenized them) and completion (the pods' usage of answers that ended)",
            ["tenant", "kind"],
            registry=registry,
        )
        self.ttft = Histogram(
            "kvroute_tenant_ttft_seconds",
            "Time to first token of streamed answers per tenant (as kvroute_ttft_seconds)",
            ["tenant"],
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.degraded = Counter(
            "kvroute_tenant_limit_degraded",
            "Limit checks made on this replica's local buckets because Redis failed",
            registry=registry,
        )


class Limiter:
    """The tenants' buckets: shared through Redis when given, else local."""

    def __init__(self, metrics: TenantMetrics, redis: RedisBuckets | None = None) -> None:
        self.metrics = metrics
        self.redis = redis
        self.local = LocalBuckets()
        self._log = RateLimitedLog(log)

    async def _take(self, key: str, capacity: float, cost: float, need: float) -> float:
        if self.redis is not None:
            try:
                return await self.redis.take(key, capacity, cost, need)
            except SharedStateUnavailable as exc:
                self.metrics.degraded.inc()
                self._log.warning("limit", "tenant limits on local buckets: %s", exc)
        return self.local.take(key, capacity, cost, need)

    async def admit_request(self, tenant: Tenant) -> None:
        """Take one request; 429 when the tenant's request bucket is empty."""
        rpm = tenant.limits.requests_per_minute
        if rpm is not None:
            wait = await self._take(f"{tenant.name}:requests", rpm, 1.0, 1.0)
            if wait > 0:
                raise self._refuse(tenant, "requests_per_minute", wait)

    async def admit_tokens(self, tenant: Tenant, prompt_tokens: int) -> None:
        """Take the prompt's tokens; 429 when the bucket holds fewer."""
        tpm = tenant.limits.tokens_per_minute
        if tpm is not None:
            need = min(float(prompt_tokens), tpm)
            wait = await self._take(f"{tenant.name}:tokens", tpm, float(prompt_tokens), need)
            if wait > 0:
                raise self._refuse(tenant, "tokens_per_minute", wait)

    async def charge_tokens(self, tenant: Tenant, tokens: int) -> None:
        """Take an answer's completion tokens (no check: the bucket may go negative)."""
        tpm = tenant.limits.tokens_per_minute
        if tpm is not None and tokens > 0:
            await self._take(f"{tenant.name}:tokens", tpm, float(tokens), -1.0)

    def _refuse(self, tenant: Tenant, limit: str, wait_s: float) -> RouterError:
        self.metrics.limited.labels(tenant.name, limit).inc()
        retry = max(1, math.ceil(wait_s))
        return RouterError(
            429,
            f"rate limit reached ({limit.replace('_', ' ')}); retry after {retry} s",
            reason="rate_limited",
            type="rate_limit_error",
            headers={"retry-after": str(retry)},
        )
