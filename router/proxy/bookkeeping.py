"""The proxy's bookkeeping around an attempt: the pod's router-tracked load, the policy's
``on_finished`` / ``on_complete`` hooks, the tenants' ``on_answer`` and the per-pod
request metrics (see "Load" in :mod:`router.proxy.forward`).

:class:`Bookkeeping` is a part of :class:`router.proxy.forward.Proxy` (its base class),
kept apart so that the attempt loop reads on its own."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from router.decision.request import Routed
from router.fleet.load import RequestLoad
from router.logs import RateLimitedLog
from router.metrics import PodMetrics, RouterMetrics
from router.proxy import answers
from scoring.policies.base import Policy

#: kinds routed without a prompt to tokenize: no prompt or cached tokens to count
_NO_PROMPT_KINDS = frozenset({"embedding", "passthrough"})


class Bookkeeping:
    """What an attempt's start and end update (a base of :class:`~router.proxy.forward.Proxy`,
    which sets these attributes)."""

    metrics: RouterMetrics
    policy: Policy
    policy_name: str
    #: called with (tenant, completion tokens) when an answer ends cleanly (limits)
    on_answer: Callable[[str | None, int | None], Awaitable[None]] | None
    #: the policy overrides ``on_finished`` (else the base's no-op is not called)
    _policy_wants_output: bool
    _log: RateLimitedLog

    def _count(self, routed: Routed, pod: str, status: int) -> None:
        self.metrics.pod_metrics(routed.model, pod, self.policy_name).requests(status).inc()

    def _served(self, routed: Routed, pod: str, pm: PodMetrics | None = None) -> None:
        """Prompt tokens and predicted cached tokens, labelled with the pod the request
        was finally sent to (after a retry: the retry's pod, not the first choice)."""
        if routed.kind in _NO_PROMPT_KINDS or pod not in routed.views:
            return
        if pm is None:
            pm = self.metrics.pod_metrics(routed.model, pod, self.policy_name)
        pm.served(routed.route.prompt_tokens, routed.cached_tokens(pod))

    async def _finish(self, load: RequestLoad, gauge: Any, routed: Routed, pod: str) -> None:
        """An attempt that failed before relaying: undo its load and bookkeeping."""
        gauge.dec()
        self.policy.on_complete(routed.route, pod)
        if load.local is not None:
            load.end_now()
        else:
            await load.end()

    async def _complete(
        self, load: RequestLoad, gauge: Any, routed: Routed, pod: str, answer: answers.Answer
    ) -> None:
        gauge.dec()
        if load.local is not None:
            load.end_now()
        else:
            await load.end()
        if answer.ok and self._policy_wants_output:
            self.policy.on_finished(routed.route, pod, answer.output_tokens)
        self.policy.on_complete(routed.route, pod)
        if answer.ok and self.on_answer is not None:
            await self.on_answer(routed.tenant, answer.output_tokens)

    def _settle(
        self,
        routed: Routed,
        pod: str,
        pm: PodMetrics,
        load: RequestLoad,
        gauge: Any,
        status: int,
        content: bytes,
        count: bool,
    ) -> None:
        """A complete answer's bookkeeping, the ``after`` of its
        :class:`~router.proxy.relay.RawResponse` (which runs it after a one-go write,
        else before the answer's messages), for a local load and no tenants: then
        nothing in it awaits, so no other request is decided before it.  A bug here is
        logged (once per type per 10 s), never raised: the answer goes out."""
        try:
            gauge.dec()
            load.end_now()
            try:
                answer = answers.of_body(
                    self.metrics,
                    routed,
                    pod,
                    status,
                    content,
                    count,
                    want_output=self._policy_wants_output,
                )
                if answer.ok and self._policy_wants_output:
                    self.policy.on_finished(routed.route, pod, answer.output_tokens)
            finally:  # the policy's request ends whatever the answer held
                self.policy.on_complete(routed.route, pod)
            self._served(routed, pod, pm)
            pm.requests(status).inc()
        except Exception as exc:
            self._log.exception(
                ("settle", type(exc).__name__), "bookkeeping of an answer from %s failed", pod
            )
