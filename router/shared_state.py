"""The one guarded Redis client of a process (``redis_url``): shared by its index, load
store, response owners and tenant limits, so one pool and one circuit breaker see every
call.  AUTH (``redis_username``, ``redis_password_file``) and TLS (``rediss://``,
``redis_ca_file``) are set here, for the router and `kvroute index` alike.

:func:`make_guard` builds it from the settings (``redis_request_deadline_s`` for calls a
request waits on, ``redis_background_deadline_s`` for the rest, the breaker's failure
count and backoff cap); :func:`count_errors` exports the breaker as
``kvroute_redis_errors_total{op,kind}`` and ``kvroute_redis_degraded``.  While Redis is
unavailable the stores raise :class:`~scoring.index.breaker.SharedStateUnavailable` (at
once while the breaker is open) and the decision core routes on what this replica has
(:mod:`router.decision.views`); requests are never failed for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from redis.backoff import EqualJitterBackoff

from router.config import Settings
from scoring.index.breaker import CircuitBreaker
from scoring.index.redis_guard import RedisGuard

#: the breaker's first wait before a probe; it doubles (jittered) up to the cap
BACKOFF_BASE_S = 0.25


def make_guard(settings: Settings) -> RedisGuard:
    """The guarded client of ``settings.redis_url`` (which must be set)."""
    assert settings.redis_url is not None
    cap = settings.redis_breaker_backoff_cap_s
    breaker = CircuitBreaker(
        name="redis",
        failures_to_open=settings.redis_breaker_failures,
        backoff=EqualJitterBackoff(cap=cap, base=min(BACKOFF_BASE_S, cap)),
    )
    return RedisGuard.from_url(
        settings.redis_url,
        breaker=breaker,
        request_deadline_s=settings.redis_request_deadline_s,
        background_deadline_s=settings.redis_background_deadline_s,
        **redis_auth(settings),
    )


def redis_auth(settings: Settings) -> dict[str, Any]:
    """The client options of AUTH and TLS: ``redis_username``, the password in
    ``redis_password_file`` (read at start; a mounted Secret), and for ``rediss://``
    the CA bundle ``redis_ca_file`` (the server's certificate and host name are
    verified)."""
    out: dict[str, Any] = {}
    if settings.redis_username:
        out["username"] = settings.redis_username
    if settings.redis_password_file:
        out["password"] = Path(settings.redis_password_file).read_text().strip()
    if settings.redis_ca_file:
        out["ssl_ca_certs"] = settings.redis_ca_file
    return out


def count_errors(guard: RedisGuard, registry: CollectorRegistry) -> None:
    """Export the guard's breaker into ``registry``: every failed call counted
    (``kvroute_redis_errors_total{op,kind}``), ``kvroute_redis_degraded`` set."""
    errors = Counter(
        "kvroute_redis_errors",
        "Failed Redis calls by operation and kind (timeout, connection, server, error; "
        "open = refused at once by the open circuit breaker)",
        ["op", "kind"],
        registry=registry,
    )
    degraded = Gauge(
        "kvroute_redis_degraded",
        "1 while the Redis circuit breaker is not closed: requests are routed on this "
        "process's own view (its local load, the prefixes it routed for hits)",
        registry=registry,
    )

    def on_error(op: str, kind: str) -> None:
        errors.labels(op, kind).inc()

    def on_state(state: str) -> None:
        degraded.set(0.0 if state == "closed" else 1.0)

    guard.breaker.listen(on_error=on_error, on_state=on_state)
    degraded.set(0.0 if guard.breaker.state == "closed" else 1.0)
