"""The one TLS client context for ``https`` pods, and the one pooled HTTP client.

Requests, scrapes and health checks all dial pods through them: an ``https`` pod is
dialled with the :class:`PodTLS` context, and the handshake is part of connecting, so a
refused certificate is a connect failure.
"""

from __future__ import annotations

import ssl

import httpx

from router.proxy.settings import ProxySettings


class PodTLS:
    """The one TLS client context for ``https`` pods (requests, scrapes, health checks),
    built on first use: loading a trust store takes ~20 ms, and the transport asks for
    it only when it dials an https pod.

    ``ca_file`` replaces the system trust store (only pods whose certificate chains to
    it are trusted); ``verify=False`` checks neither the certificate nor the host name
    (encrypted, but anyone on the path can pose as a pod: insecure).
    """

    def __init__(self, ca_file: str | None = None, verify: bool = True) -> None:
        self.ca_file = ca_file
        self.verify = verify
        self._context: ssl.SSLContext | None = None

    @classmethod
    def from_settings(cls, settings: ProxySettings) -> PodTLS:
        return cls(settings.pod_ca_file, settings.pod_tls_verify)

    def context(self) -> ssl.SSLContext:
        if self._context is None:
            if self.verify:
                ctx = ssl.create_default_context(cafile=self.ca_file)
            else:
                ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            self._context = ctx
        return self._context


def make_client(
    settings: ProxySettings, transport: httpx.AsyncBaseTransport | None = None
) -> httpx.AsyncClient:
    """The one pooled client: keep-alive, HTTP/1.1, configurable timeouts; requests go
    through ``transport`` (a :class:`PodTransport`) or httpx's default pool."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(
            connect=settings.connect_timeout_s,
            read=settings.read_timeout_s,
            write=settings.read_timeout_s,
            pool=settings.connect_timeout_s,
        ),
        limits=httpx.Limits(max_keepalive_connections=settings.max_keepalive, keepalive_expiry=30),
        http1=True,
        http2=False,
        follow_redirects=False,
        trust_env=False,
        transport=transport,
    )
