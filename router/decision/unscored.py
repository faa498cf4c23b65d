"""The decisions that score no prompt: a Responses follow-up goes to the pod owning its
``previous_response_id``, a response that does not convert exactly to chat is routed
least-loaded (counted as unscored), and so are embeddings and passthrough requests
(no prefix to follow).  A new response that converts to chat is scored like a chat.

:class:`UnscoredRoutes` is a part of :class:`router.decision.core.RequestRouter` (its
base class)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from router.decision.owners import OwnerStore
from router.decision.request import Kind, Routed, without_prompt
from router.decision.responses import Unscored, to_chat
from router.decision.views import ViewBuilder
from router.errors import RouterError, bad_request
from router.fleet.pods import PodRegistry, PodState
from router.fleet.roles import can_decode
from router.logs import RateLimitedLog
from router.metrics import RouterMetrics

log = logging.getLogger(__name__)
_limited = RateLimitedLog(log)  # per-request warnings: one line per cause per 10 s


class UnscoredRoutes:
    """Routing without a prompt's score (a base of
    :class:`~router.decision.core.RequestRouter`, which sets these attributes)."""

    registry: PodRegistry
    metrics: RouterMetrics
    views: ViewBuilder
    #: who created which stored response (``/v1/responses``); set by the app
    owners: OwnerStore | None
    #: the rotation of least-loaded ties
    _rr: int

    def reject(self, err: RouterError) -> RouterError:
        """Count a rejected request by its reason, and return the error to raise."""
        self.metrics.child(self.metrics.bad_requests, err.reason).inc()
        return err

    async def _responses(
        self,
        body: dict[str, Any],
        model: str,
        stream: bool,
        pods: Sequence[PodState],
        request_id: str,
        tenant: str | None = None,
    ) -> Routed | tuple[list[dict[str, Any]], dict[str, Any]]:
        """A ``/v1/responses`` body: a follow-up goes to the pod owning its
        ``previous_response_id`` (a decided :class:`Routed`); a new response that
        converts exactly to chat -> (messages, the chat body to encode); anything else is
        routed least-loaded and counted as unscored."""
        inp = body.get("input")
        if not isinstance(inp, (str, list)):
            raise bad_request(
                "'input' is required: a string or a list of input items", "invalid_input", "input"
            )
        previous = body.get("previous_response_id")
        if previous is not None:
            if not isinstance(previous, str) or not previous:
                raise bad_request(
                    "'previous_response_id' must be a string",
                    "invalid_previous_response_id",
                    "previous_response_id",
                )
            owner = await self._owner(previous, tenant)
            m = self.metrics
            if owner is not None and any(p.name == owner for p in pods):
                m.child(m.responses_affinity, "owner").inc()
                return await self._decide_owner(body, model, stream, owner, request_id)
            m.child(m.responses_affinity, "unknown" if owner is None else "owner_gone").inc()
            if owner is None and tenant is not None:
                # not this tenant's (or unknown): never sent on, where the pod holding it
                # would continue another tenant's conversation
                raise _response_not_found(previous, "previous_response_id")
            # the history lives on a pod we cannot reach: no exact prompt to score (the
            # pod answers 404, which is relayed)
            reason = "previous_response_id"
            return await self._unscored(reason, body, model, stream, pods, request_id)
        try:
            form = to_chat(body)
        except Unscored as why:
            return await self._unscored(why.reason, body, model, stream, pods, request_id)
        chat_body: dict[str, Any] = {"tools": form.tools}
        for key in ("chat_template_kwargs", "cache_salt"):
            if key in body:
                chat_body[key] = body[key]
        return form.messages, chat_body

    async def _owner(self, response_id: str, tenant: str | None = None) -> str | None:
        """The pod that created ``response_id`` for ``tenant`` (None: not known to the
        owner store, or another tenant's)."""
        if self.owners is None:
            return None
        try:
            return await self.owners.get(response_id, tenant)
        except Exception as exc:  # the store is down: route as if unknown
            _limited.warning("owner_get", "response owner lookup failed: %r", exc)
            self.metrics.child(self.metrics.responses_affinity, "store_error").inc()
            return None

    async def owner_of(self, response_id: str, tenant: str | None = None) -> str:
        """The registered pod that created ``response_id`` (GET, cancel); 404 when the
        router knows no owner (or ``tenant`` did not create it), or its pod left (counted)."""
        m = self.metrics
        owner = await self._owner(response_id, tenant)
        if owner is not None and self.registry.get(owner) is not None:
            m.child(m.responses_affinity, "owner").inc()
            return owner
        m.child(m.responses_affinity, "unknown" if owner is None else "owner_gone").inc()
        why = "is not known to the router" if owner is None else f"was stored on pod {owner}, gone"
        raise self.reject(
            RouterError(
                404,
                f"Response with id '{response_id}' not found: it {why}",
                reason="response_not_found",
                param="response_id",
            )
        )

    async def _unscored(
        self,
        reason: str,
        body: dict[str, Any],
        model: str,
        stream: bool,
        pods: Sequence[PodState],
        request_id: str,
    ) -> Routed:
        self.metrics.child(self.metrics.responses_unscored, reason).inc()
        return await self._decide_least_loaded("responses", body, model, stream, pods, request_id)

    async def _decide_owner(
        self, body: dict[str, Any], model: str, stream: bool, owner: str, request_id: str
    ) -> Routed:
        """A follow-up: only the owner (any other pod answers 404, so no retry there)."""
        views = await self.views.views((), [owner])
        return without_prompt(
            "responses",
            body,
            model,
            stream,
            request_id,
            [owner],
            {owner: 0.0},
            views,
            {"affinity": "owner"},
        )

    async def _decide_least_loaded(
        self,
        kind: Kind,
        body: dict[str, Any],
        model: str,
        stream: bool,
        pods: Sequence[PodState],
        request_id: str,
    ) -> Routed:
        """Embeddings and passthrough requests: no prefix to follow (an embedding leaves
        no reusable KV cache), so least in-flight, ties rotated.  A whole request goes
        to a pod that may take one: prefill-only pods only when no other pod is left."""
        whole = [p for p in pods if can_decode(p.role_for(model))]
        names = [p.name for p in (whole or pods)]
        views = await self.views.views((), names)
        self._rr += 1
        order = sorted(
            range(len(names)),
            key=lambda i: (views[names[i]].inflight, (i - self._rr) % len(names)),
        )
        ranking = [names[i] for i in order]
        scores = {n: float(views[n].inflight) for n in names}
        return without_prompt(kind, body, model, stream, request_id, ranking, scores, views)


def _response_not_found(response_id: str, param: str) -> RouterError:
    return RouterError(
        404,
        f"Response with id '{response_id}' not found",
        reason="response_not_found",
        param=param,
    )
