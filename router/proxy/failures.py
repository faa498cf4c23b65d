"""Why an attempt failed, as the OpenAI error a client sees: a stall before the first
byte (its pod ejected or removed, or its first-byte deadline passed), and a failed
exchange with a pod (connect, timeout, transport); and the registry's hooks that cancel
the attempts waiting on a pod that was ejected or left (see "Retry", "Failover" and
"Errors" in :mod:`router.proxy.forward`).

:class:`Failures` is a part of :class:`router.proxy.forward.Proxy` (its base class)."""

from __future__ import annotations

from typing import Any

import httpx

from router.errors import RouterError
from router.logs import RateLimitedLog
from router.metrics import RouterMetrics
from router.proxy.attempts import FIRST_BYTE_TIMEOUT, POD_EJECTED, POD_REMOVED, AttemptWatch
from router.proxy.settings import ProxySettings

#: pod answers that move a request to the next pod of the ranking (before any byte)
RETRYABLE_STATUS = frozenset({502, 503})


class Stalled(Exception):
    """An attempt cancelled before its first byte: its pod was ejected or removed, or
    its first-byte deadline passed (``cause``)."""

    def __init__(self, cause: str) -> None:
        super().__init__(cause)
        self.cause = cause


class Failures:
    """The errors of failed attempts and the pod hooks that fail attempts over (a base of
    :class:`~router.proxy.forward.Proxy`, which sets these attributes)."""

    metrics: RouterMetrics
    _watch: AttemptWatch
    _log: RateLimitedLog
    _first_byte_timeout: float | None
    settings: ProxySettings
    _relaying: dict[str, set[Any]]

    def _stall_error(self, pod: str, cause: str) -> RouterError:
        """The OpenAI error for an attempt cancelled before its first byte: 504
        ``first_byte_timeout``, 502 ``pod_ejected`` / ``pod_removed``; counted by pod and
        reason (except for a removed pod: its series were just dropped from /metrics)."""
        if cause != POD_REMOVED:
            m = self.metrics
            m.child(m.upstream_errors, pod, cause).inc()
        if cause == FIRST_BYTE_TIMEOUT:
            return RouterError(
                504,
                f"pod {pod} sent no first byte within {self._first_byte_timeout:g} s "
                "(proxy.first_byte_timeout_s)",
                reason=cause,
            )
        what = "was ejected by health checks" if cause == POD_EJECTED else "left the fleet"
        return RouterError(502, f"pod {pod} {what} while the request waited for it", reason=cause)

    def _on_health(self, pod: str, healthy: bool) -> None:
        if not healthy:
            self._fail_pod(pod, POD_EJECTED)

    def _on_pod(self, pod: str, spec: object) -> None:
        if spec is None:
            self._fail_pod(pod, POD_REMOVED)

    def _fail_pod(self, pod: str, cause: str) -> None:
        idle = self.settings.ejected_stream_idle_s
        for body in self._relaying.get(pod, ()):
            limit = getattr(body, "limit_silence", None)  # (a test's transport may lack it)
            if limit is not None:
                limit(idle)
        n = self._watch.fail_pod(pod, cause)
        if n:
            self._log.warning(
                ("fail_pod", pod, cause),
                "pod %s %s: %d requests still waiting for its first byte are cancelled there "
                "and failed over",
                pod,
                "ejected" if cause == POD_EJECTED else "removed",
                n,
            )

    def _upstream_error(self, pod: str, exc: httpx.HTTPError) -> RouterError:
        """The OpenAI error for a failed exchange with ``pod`` (counted by reason):
        502 ``connect`` (nothing was sent), 504 ``upstream_timeout``, 502 ``transport``."""
        m = self.metrics
        if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)):
            m.child(m.upstream_errors, pod, "connect").inc()
            return RouterError(502, f"cannot connect to pod {pod}: {exc!r}", reason="connect")
        if isinstance(exc, httpx.TimeoutException):
            m.child(m.upstream_errors, pod, "timeout").inc()
            return RouterError(504, f"pod {pod} did not answer in time", reason="upstream_timeout")
        m.child(m.upstream_errors, pod, "transport").inc()
        return RouterError(502, f"pod {pod} failed: {exc!r}", reason="transport")
