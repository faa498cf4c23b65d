"""The tenant rules on a request's path, for every front (`kvroute serve`, `kvroute epp`).

In order, for a generation request (chat, completion, embeddings, responses):

1. :meth:`TenantGate.identify` -- the tenant (401 without a valid key);
2. :meth:`TenantGate.admit` -- the body's model must be one the tenant may use (else the
   same 404 as a model no pod serves: a tenant cannot tell a model it may not use from
   one that does not exist, so the fleet's other models stay unnamed), its request
   bucket must hold a request (else 429), and the body's ``cache_salt`` is set to the
   tenant's salt, over whatever the client sent (:func:`router.rewrite.rewrite_body`);
   with ``ask_usage`` (the proxy front) a chat or completion stream whose client did not
   ask for its usage gets ``stream_options.include_usage`` too, so that its completion
   tokens are known (:mod:`router.proxy.hidden_usage` takes the usage event back out of
   the client's stream);
3. :meth:`TenantGate.admit_tokens` -- after the decision, the prompt's tokens are taken
   from the tenant's token bucket (else 429);
4. :meth:`TenantGate.on_answer` -- the answer's completion tokens are taken too.

The prompt and completion tokens and the streams' time to first token are counted per
tenant (``kvroute_tenant_tokens_total``, ``kvroute_tenant_ttft_seconds``).

:meth:`TenantGate.public` turns an error into what a tenant may see: no pod problems
(which name pod URLs and addresses), no discovery hints, no models of other tenants.
The full message goes to the log (rate limited) instead.  :meth:`TenantGate.facing`
drops the pod header from error responses (a pod's 5xx body is replaced by the fronts:
``Proxy.hide_pod_errors``, the EPP's response body).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry

from router.errors import RouterError
from router.logs import RateLimitedLog
from router.proxy.hidden_usage import asks_for_usage, usage_options
from router.rewrite import rewrite_body
from router.tenants.auth import Tenancy, TenantContext
from router.tenants.limits import Limiter, RedisBuckets, TenantMetrics

log = logging.getLogger(__name__)

#: the kinds whose bodies reach a prompt cache (their cache_salt is set)
SALTED_KINDS = frozenset({"chat", "completion", "responses"})
#: the label of requests with no valid key
UNAUTHENTICATED = "unauthenticated"

#: error reasons whose messages carry fleet internals, and what a tenant sees instead
_GENERIC = {
    "no_healthy_pod": "no healthy pod serves the model right now; retry later",
    "no_pods": "no pod is available right now; retry later",
    "no_pod_in_subset": "no pod is available right now; retry later",
    "no_pod": "no pod is available right now; retry later",
    "connect": "the model server could not be reached; retry later",
    "transport": "the model server failed while answering",
    "stream_error": "the model server failed while answering",
    "stream_unreadable": "the model server's answer could not be read",
    "upstream_timeout": "the model server did not answer in time",
    "first_byte_timeout": "the model server did not start answering in time",
    "pod_ejected": "the model server became unavailable while the request waited",
    "pod_removed": "the model server left while the request waited",
    "internal": "internal router error",
}


class TenantGate:
    """The tenants of one process and what they may do."""

    def __init__(
        self,
        settings: Any,
        registry: CollectorRegistry,
        redis: Any = None,
    ) -> None:
        self.tenancy = Tenancy(
            settings.tenants,
            settings.salt_secret(),
            settings.security,
            settings.admin_keys,
            settings.admin_key_sha256,
        )
        self.enabled = self.tenancy.enabled
        self.metrics = TenantMetrics(registry)
        buckets = (
            RedisBuckets(redis, settings.redis_namespace)
            if redis is not None and self.enabled
            else None
        )
        self.limiter = Limiter(self.metrics, buckets)
        self._log = RateLimitedLog(log)

    # -- the request path ------------------------------------------------------------

    def identify(
        self, headers: Mapping[str, str], client: Sequence[object] | None
    ) -> TenantContext | None:
        """The request's tenant (None: tenancy off); a 401 is counted."""
        try:
            return self.tenancy.identify(headers, client)
        except RouterError:
            self.count(None, 401)
            raise

    def check_model(self, ctx: TenantContext, model: Any, served: Collection[str]) -> None:
        """404 ``model_not_found`` when ``ctx`` may not use ``model`` (as if it did not
        exist); the message lists only the tenant's models."""
        if isinstance(model, str) and model and not ctx.allows(model):
            raise self.not_found(ctx, model, served)

    def not_found(self, ctx: TenantContext, model: str, served: Collection[str]) -> RouterError:
        mine = ", ".join(sorted(m for m in served if ctx.allows(m))) or "none"
        return RouterError(
            404,
            f"the model {model!r} does not exist; served models: {mine}",
            reason="model_not_found",
            param="model",
        )

    async def admit(
        self,
        ctx: TenantContext,
        kind: str,
        body: dict[str, Any],
        raw: bytes,
        served: Collection[str],
        ask_usage: bool = False,
    ) -> bytes:
        """The model check and the request bucket; ``body`` gets the tenant's salt (in
        place) and the bytes to forward are returned.  ``ask_usage``: a stream whose
        client did not ask for its usage asks for it (in the bytes only: ``body`` keeps
        the client's ``stream_options``, which is how the relay knows to hide it)."""
        self.check_model(ctx, body.get("model"), served)
        await self.limiter.admit_request(ctx.tenant)
        if kind not in SALTED_KINDS:
            return raw
        sets: dict[str, Any] = {"cache_salt": ctx.salt}
        if ask_usage and asks_for_usage(kind, body):
            sets["stream_options"] = usage_options(body)
        out = rewrite_body(raw, body, set_fields=sets)
        body["cache_salt"] = ctx.salt
        return out

    async def admit_tokens(self, ctx: TenantContext, prompt_tokens: int) -> None:
        await self.limiter.admit_tokens(ctx.tenant, prompt_tokens)
        self.metrics.tokens.labels(ctx.name, "prompt").inc(prompt_tokens)

    def observe_ttft(self, tenant: str | None, ttft: float) -> None:
        """A stream's time to first token, counted for its tenant."""
        if tenant is not None and self.tenancy.context(tenant) is not None:
            self.metrics.ttft.labels(tenant).observe(ttft)

    async def on_answer(self, tenant: str | None, completion_tokens: int | None) -> None:
        """An answer ended: its completion tokens are counted and taken from the
        tenant's bucket."""
        ctx = self.tenancy.context(tenant) if tenant is not None else None
        if ctx is None or not completion_tokens:
            return
        self.metrics.tokens.labels(ctx.name, "completion").inc(completion_tokens)
        try:
            await self.limiter.charge_tokens(ctx.tenant, completion_tokens)
        except Exception as exc:  # never fails an answer already sent
            self._log.warning("charge", "charging completion tokens failed: %r", exc)

    # -- what a tenant sees ----------------------------------------------------------

    def public(self, err: RouterError, ctx: TenantContext | None = None) -> RouterError:
        """``err`` as a tenant may see it (unchanged with tenancy off)."""
        if not self.enabled:
            return err
        generic = _GENERIC.get(err.reason)
        if generic is None and err.reason.startswith("status_"):
            generic = "the model server is unavailable; retry later"
        if generic is None:
            return err
        self._log.warning(("public", err.reason), "%s (tenant sees: %s)", err.message, generic)
        return RouterError(
            err.status, generic, reason=err.reason, type=err.type, headers=err.headers
        )

    def facing(self, response: Any, pod_header: bytes) -> Any:
        """A tenant-facing ``response`` (a Starlette response): an error (status >= 400)
        carries no ``pod_header`` (a pod's name is its address under DNS discovery; the
        log has the pod).  Unchanged with tenancy off."""
        if self.enabled and response.status_code >= 400:
            response.raw_headers = [h for h in response.raw_headers if h[0] != pod_header]
        return response

    def count(self, ctx: TenantContext | None, status: int) -> None:
        if self.enabled:
            name = ctx.name if ctx is not None else UNAUTHENTICATED
            self.metrics.requests.labels(name, str(status)).inc()

    # -- introspection ---------------------------------------------------------------

    def introspect(self, access: str, headers: Mapping[str, str]) -> None:
        """``/v1/route``, ``/metrics``, ``/openapi.json`` under ``access`` (admin, open,
        off): 404 when off, 403 without an admin key when admin (only once tenants or
        admin keys are configured)."""
        if access == "off":
            raise RouterError(404, "Not Found", reason="http")
        if access == "open" or not self.tenancy.guarded:
            return
        if not self.tenancy.is_admin(headers):
            raise RouterError(
                403,
                "this endpoint needs an admin key (send 'Authorization: Bearer <admin key>')",
                reason="forbidden",
                type="permission_error",
            )
