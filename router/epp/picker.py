"""The EPP front's state: a :class:`~router.core.RouterCore` (the same fleet, index,
KV events, load, policy and decision core as `kvroute serve`) plus what picking for a
proxy needs: pods as ``ip:port`` endpoints, the subset hint, the EPP's metrics.

What goes where (the request's path decides, as in the proxy front):

* ``/v1/chat/completions``, ``/v1/completions``, ``/v1/embeddings``, ``/v1/responses``:
  the body goes through :meth:`RequestRouter.decide` exactly as `kvroute serve` sends
  it (same validation, same errors, same ranking);
* ``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``: the pod that stored
  the response (404 when unknown);
* any other path with a JSON body naming a model (or with one model served): a
  passthrough, least loaded among the pods serving it (as ``proxy.passthrough_paths``);
* anything else (no body, a body that is not JSON): least loaded among the healthy
  pods (``GET /v1/models`` and the like).

The endpoint list is the ranking's first ``endpoints`` pods (default 1: Envoy's
``ORIGINAL_DST`` cluster takes one address; a proxy that walks a list on retries —
Envoy's ``override_host`` policy, GKE — can take more).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from typing import Any

from router.config import Settings
from router.core import RouterCore
from router.decision.request import Kind, Routed, parse_body
from router.epp import protocol as P
from router.epp.endpoints import Endpoints
from router.epp.metrics import EppMetrics
from router.errors import RouterError
from router.fleet.pods import PodSpec
from router.proxy.hidden_usage import asks_for_usage
from router.tenants.auth import TenantContext
from router.tenants.gate import TenantGate

#: the proxy front's generation endpoints (their bodies must be valid)
ROUTED_PATHS: dict[str, Kind] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/v1/embeddings": "embedding",
    "/v1/responses": "responses",
}
_STORED_RESPONSE = re.compile(r"^/v1/responses/([^/]+)(/cancel)?$")


def route_path(path: str) -> str:
    """``:path`` without its query string."""
    return path.split("?", 1)[0]


class EndpointPicker(RouterCore):
    """Everything one `kvroute epp` process owns."""

    def __init__(self, settings: Settings, *, endpoints: int = 1) -> None:
        super().__init__(settings, "epp")
        if endpoints < 1:
            raise ValueError(f"endpoints must be >= 1, got {endpoints}")
        self.endpoints_per_pick = endpoints
        self.endpoints = Endpoints(self.registry)
        self.epp = EppMetrics(self.metrics.registry, lambda: len(self.endpoints.unaddressable))
        self._served_answers: dict[str | None, P.ProcessingResponse] = {}
        self.registry.subscribe(self._forget)
        #: the tenants: keys, models, limits and cache salts as in `kvroute serve`
        self.tenants = TenantGate(settings, self.metrics.registry, self.redis)

    def _forget(self, name: str, spec: PodSpec | None) -> None:
        if spec is None:
            self.epp.forget_pod(name)
            self._served_answers.pop(name, None)

    def _allowed(self, subset: list[str] | None) -> Collection[str] | None:
        """The pods a pick may name (None: every candidate)."""
        unaddressable = self.endpoints.unaddressable
        if subset is None:
            return self.endpoints.addressable() if unaddressable else None
        return self.endpoints.allowed(subset)

    async def admit(
        self, path: str, body: bytes, headers: Mapping[str, str]
    ) -> tuple[bytes, TenantContext | None, bool]:
        """With tenants: the request's tenant (401), and for a generation path its
        model (404), request bucket (429) and cache salt; returns the body to send on
        (the client's bytes, or with the tenant's ``cache_salt``, and for a stream
        whose client did not ask for its usage, ``include_usage``), the tenant, and
        whether the usage was asked for on the client's behalf (then hidden from it)."""
        gate = self.tenants
        if not gate.enabled:
            return body, None, False
        try:
            ctx = gate.identify(headers, None)  # the peer is the proxy: keys only
            assert ctx is not None
            kind = ROUTED_PATHS.get(path)
            if kind is None:
                return body, ctx, False
            parsed = parse_body(body)
            asked = asks_for_usage(kind, parsed)
            served = self.registry.served_models()
            out = await gate.admit(ctx, kind, parsed, body, served, ask_usage=True)
        except RouterError as err:
            raise self.router.reject(err) from None
        return out, ctx, asked

    async def decide(
        self,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        subset: list[str] | None,
        tenant: TenantContext | None = None,
    ) -> Routed | list[str]:
        """The decision for one request: a :class:`Routed` (scored, or least loaded as
        the decision core does it), or for a request the core does not route, the
        pods least loaded first.  Raises :class:`RouterError` (counted)."""
        only = self._allowed(subset)
        kind = ROUTED_PATHS.get(path)
        name = tenant.name if tenant is not None else None
        if kind is not None:
            try:
                parsed = parse_body(body)
            except RouterError as err:
                raise self.router.reject(err) from None
            routed = await self.router.decide(kind, parsed, headers, only=only, tenant=name)
            if tenant is not None:
                try:
                    await self.tenants.admit_tokens(tenant, routed.route.prompt_tokens)
                except RouterError as err:
                    raise self.router.reject(err) from None
            return routed
        stored = _STORED_RESPONSE.match(path)
        if stored is not None:
            owner = await self.router.owner_of(stored.group(1), name)
            if only is not None and owner not in only:
                raise self.router.reject(
                    RouterError(
                        503,
                        f"the response's pod {owner} is not among the allowed endpoints",
                        reason="no_pod_in_subset",
                    )
                )
            return [owner]
        passthrough = _json_with_model(body, self.registry.served_models())
        if passthrough is not None:
            if tenant is not None:
                self.tenants.check_model(
                    tenant, passthrough.get("model"), self.registry.served_models()
                )
            return await self.router.decide(
                "passthrough", passthrough, headers, only=only, tenant=name
            )
        return await self.least_loaded(only)

    async def least_loaded(self, only: Collection[str] | None) -> list[str]:
        """Healthy pods (within ``only``), fewest in flight first (503 when none)."""
        names = [p.name for p in self.registry.all() if p.healthy]
        if only is not None:
            names = [n for n in names if n in only]
        if not names:
            raise self.router.reject(
                RouterError(503, "no healthy endpoint to send the request to", reason="no_pod")
            )
        views = await self.router.views.views((), names)
        return sorted(names, key=lambda n: views[n].inflight)

    def endpoint_list(self, ranking: list[str]) -> str:
        return self.endpoints.join(ranking, self.endpoints_per_pick)

    def served_answer(self, pod: str | None) -> P.ProcessingResponse:
        """The response-headers answer naming ``pod`` in ``pod_header`` (None: nothing
        set), built once per pod: messages are only read once built, and building one
        costs more than sending it."""
        answer = self._served_answers.get(pod)
        if answer is None:
            extra = {self.settings.pod_header: pod} if pod is not None else None
            answer = self._served_answers[pod] = P.headers_response(False, extra)
        return answer


def _json_with_model(body: bytes, served: set[str]) -> dict[str, Any] | None:
    """A passthrough body the decision core can route: a JSON object with a ``model``
    (or any JSON object when exactly one model is served)."""
    if not body:
        return None
    try:
        parsed = parse_body(body)
    except RouterError:
        return None
    model = parsed.get("model")
    if isinstance(model, str) and model:
        return parsed
    return parsed if model is None and len(served) == 1 else None
