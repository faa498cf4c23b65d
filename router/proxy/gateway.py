"""The proxy front's state: a :class:`~router.core.RouterCore` plus the
:class:`~router.proxy.forward.Proxy` that forwards decided requests, the router's API
keys or its tenants (:class:`~router.tenants.gate.TenantGate`) and the request-body
reader (413 past ``proxy.max_body_bytes``)."""

from __future__ import annotations

import contextlib
import hmac
from collections.abc import Mapping

from fastapi import Request
from starlette.types import Receive

from router.config import Settings
from router.core import RouterCore
from router.errors import RouterError
from router.proxy.access_log import AccessLog
from router.proxy.disagg import Disaggregator
from router.proxy.forward import Proxy
from router.tenants.gate import TenantGate


class Gateway(RouterCore):
    """Everything one proxy-front app owns."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings, "serve")
        self.proxy = Proxy(
            self.client,
            settings.proxy,
            self.registry,
            self.load,
            self.policy,
            self.metrics,
            policy_name=settings.policy,
            pod_header=settings.pod_header,
            forward_authorization=not settings.api_keys and not settings.tenants,
            pending=self.pending,
            transport=self.transport,
        )
        self.proxy.owners = self.owners
        p = settings.proxy
        self.access_log = AccessLog(
            p.access_log == "on",
            p.access_log_sample,
            p.access_log_format,
            pod_header=settings.pod_header,
        )
        self.pod_header_b = settings.pod_header.lower().encode("latin-1")
        #: the tenants (router.tenants): keys, salts, limits, what a tenant may see
        self.tenants = TenantGate(settings, self.metrics.registry, self.redis)
        if self.tenants.enabled:
            self.proxy.public = self.tenants.public
            self.proxy.hide_pod_errors = True
            self.proxy.on_answer = self.tenants.on_answer
            self.proxy.on_ttft = self.tenants.observe_ttft
        #: requests of models whose pods have P/D roles (router/proxy/disagg.py)
        self.disagg = Disaggregator(self.proxy, self.router.pd, settings.pd)
        if self.learner.enabled:
            self.proxy.on_sent = self.router.sent
        self.proxy.first_tokens = self.first_tokens
        self._api_keys = [k.encode() for k in settings.api_keys]
        self.max_json_depth = settings.proxy.max_json_depth

    async def stop(self) -> None:
        await super().stop()
        with contextlib.suppress(Exception):
            await self.proxy.aclose()

    def check_api_key(self, headers: Mapping[str, str]) -> None:
        """401 unless router API keys are off or ``Authorization: Bearer <key>`` matches."""
        if not self._api_keys:
            return
        auth = headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() == "bearer" and any(
            hmac.compare_digest(token.strip().encode(), k) for k in self._api_keys
        ):
            return
        raise self.router.reject(
            RouterError(
                401,
                "invalid or missing API key (send 'Authorization: Bearer <key>')",
                reason="unauthorized",
                type="authentication_error",
            )
        )

    def _too_big(self) -> RouterError:
        limit = self.settings.proxy.max_body_bytes
        return self.router.reject(
            RouterError(
                413,
                f"request body larger than {limit} bytes (proxy.max_body_bytes)",
                reason="body_too_large",
            )
        )

    async def read_body(self, request: Request) -> bytes:
        return await self.receive_body(request.headers, request.receive)

    async def receive_body(self, headers: Mapping[str, str], receive: Receive) -> bytes:
        """The request body from ASGI ``receive``; 413 past ``proxy.max_body_bytes``
        (at once when Content-Length says so)."""
        limit = self.settings.proxy.max_body_bytes
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise self._too_big()
        message = await receive()
        body: bytes = message.get("body", b"")
        if not message.get("more_body", False):  # the common case: one message
            if len(body) > limit:
                raise self._too_big()
            return body
        chunks = [body]
        size = len(body)
        while message.get("more_body", False):
            message = await receive()
            if message["type"] == "http.disconnect":
                raise RouterError(499, "client disconnected", reason="client_disconnected")
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise self._too_big()
            chunks.append(chunk)
        return b"".join(chunks)
