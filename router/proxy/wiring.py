"""What a :class:`~router.proxy.forward.Proxy` is built from and holds: its client,
settings, registry, load store, policy and metrics; the pod transport (its own unless
given one) and the parsed pod targets; the registry's hooks that fail over the attempts
waiting on an ejected or removed pod (:mod:`.failures`); the hooks its owner sets
(owners, public errors, ``on_answer``, ``on_ttft``, ``on_sent``); and the forwarded
request head (:mod:`.head`).

:class:`ProxyWiring` is a part of :class:`router.proxy.forward.Proxy` (its base class),
kept apart so that the attempt loop reads on its own."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from router.decision.owners import OwnerStore
from router.decision.request import Routed
from router.errors import RouterError
from router.fleet.first_tokens import FirstTokenLedger
from router.fleet.load import LoadStore, PendingLoad
from router.fleet.pods import PodRegistry
from router.fleet.tls import PodTLS
from router.fleet.transport import PodTarget, PodTransport
from router.logs import RateLimitedLog
from router.metrics import RouterMetrics
from router.proxy.attempts import AttemptWatch
from router.proxy.head import DROP_REQUEST_B, head_tail
from router.proxy.settings import ProxySettings
from router.proxy.streaming import StreamRelay
from scoring.policies.base import Policy, reads_output

#: the proxy's per-request warnings keep the logger of the attempt loop's module
log = logging.getLogger("router.proxy.forward")


def _as_is(err: RouterError) -> RouterError:
    return err


class ProxyWiring(StreamRelay):
    """The proxy's construction, its pod targets and forwarded head (a base of
    :class:`~router.proxy.forward.Proxy`, whose attempt loop uses them)."""

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
        pending: PendingLoad | None = None,
        transport: PodTransport | None = None,
    ) -> None:
        self.client = client
        self.settings = settings
        self.registry = registry
        self.load = load
        self.policy = policy
        self.metrics = metrics
        self.policy_name = policy_name
        self.pod_header = pod_header
        self._pod_header_b = pod_header.lower().encode("latin-1")
        self.forward_authorization = forward_authorization
        self.pending = pending if pending is not None else PendingLoad()
        #: requests go straight to this transport as bytes (httpx's request / response
        #: objects and client layers cost more than the rest of the proxying)
        self._own_transport = transport is None
        self.transport = transport or PodTransport(
            settings.max_keepalive, PodTLS.from_settings(settings)
        )
        self._targets: dict[tuple[str, str], PodTarget] = {}
        self._watch = AttemptWatch()
        #: per-request warnings: one line per cause per 10 s
        self._log = RateLimitedLog(log)
        self._connect_timeout = settings.connect_timeout_s
        self._read_timeout = settings.read_timeout_s
        self._first_byte_timeout = settings.first_byte_timeout_s
        self._stream_json = settings.stream_json_answers
        #: the upstream bodies relaying per pod (an ejection limits their silence)
        self._relaying: dict[str, set[Any]] = {}
        registry.subscribe_health(self._on_health)
        registry.subscribe(self._on_pod)
        self._drop = DROP_REQUEST_B | (
            frozenset() if forward_authorization else frozenset({b"authorization"})
        )
        #: where a created response's owner is recorded (``/v1/responses``)
        self.owners: OwnerStore | None = None
        #: what a client may see of an upstream error (tenancy strips fleet internals)
        self.public: Callable[[RouterError], RouterError] = _as_is
        #: a pod's own 5xx body is not relayed but replaced by :attr:`public`'s error
        #: (tenants: it may name the fleet's internals; it is logged instead)
        self.hide_pod_errors = False
        #: called with (tenant, completion tokens) when an answer ends cleanly (limits)
        self.on_answer: Callable[[str | None, int | None], Awaitable[None]] | None = None
        #: told of a stream's time to first token by tenant (the tenants' dashboard row)
        self.on_ttft: Callable[[str | None, float], None] | None = None
        #: the policy reads the output tokens (``on_finished`` is its own): every answer's
        #: usage is decoded for it (else only those reporting cached tokens, for metrics)
        self._policy_wants_output = reads_output(policy)
        #: told of every attempt as it starts, like the policy (the speculative entries,
        #: ``RequestRouter.sent``)
        self.on_sent: Callable[[Routed, str], None] | None = None
        #: the requests whose first token is not seen here, released by the pods' counts
        #: (router/fleet/first_tokens.py)
        self.first_tokens: FirstTokenLedger | None = None

    async def aclose(self) -> None:
        """Close the transport if this proxy made its own."""
        if self._own_transport:
            await self.transport.aclose()

    def _head_tail(self, incoming: list[tuple[bytes, bytes]], length: int) -> bytes:
        """The forwarded headers (hop-by-hop and Host dropped), Content-Length, identity
        encoding and the blank line: everything of the head after the Host line."""
        return head_tail(incoming, self._drop, length)

    def _target(self, url: str, path: str) -> PodTarget:
        key = (url, path)
        target = self._targets.get(key)
        if target is None:  # parsing a URL costs more than the rest of the request head
            if len(self._targets) > 4096:
                self._targets.clear()
            target = self._targets[key] = PodTarget(url, path)
        return target
