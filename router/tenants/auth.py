"""Who is asking: the tenant of a request, and whether a caller holds an admin key.

* A tenant is identified by ``Authorization: Bearer <key>``: the key's SHA-256 digest is
  compared with every tenant's digest with :func:`hmac.compare_digest` (constant time,
  and every digest is compared, so the time does not tell which tenant, if any, came
  close).  Plaintext ``key`` entries are hashed once at start.
* Or, when ``security.tenant_header`` is set, by that header — but only from a TCP peer
  inside ``security.tenant_header_networks`` (the ASGI scope's ``client``; never a
  forwarded-for header, which the client writes).  From anywhere else the header is
  ignored and the key decides.
* No key, a wrong key, a header naming no tenant: 401 ``authentication_error``.

The cache salt of a tenant is ``HMAC-SHA256(tenant_salt_secret, "kvroute cache_salt\\0"
+ name)`` (hex); ``share_cache`` tenants all get the one salt of the name
:data:`SHARED`.  Neither the salt nor the secret is ever sent to a client.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from router.errors import RouterError
from router.tenants.settings import SecuritySettings, Tenant

#: the salt name of the share_cache tenants (not a valid tenant name: no clash)
SHARED = "*shared*"
_SALT_CONTEXT = b"kvroute cache_salt\x00"

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class TenantContext:
    """The tenant of one request, as the router applies it."""

    name: str
    models: frozenset[str]
    salt: str
    tenant: Tenant

    def allows(self, model: str) -> bool:
        return not self.models or model in self.models


def sha256_hex(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def unauthorized(what: str = "invalid or missing API key") -> RouterError:
    return RouterError(
        401,
        f"{what} (send 'Authorization: Bearer <key>')",
        reason="unauthorized",
        type="authentication_error",
    )


def bearer(headers: Mapping[str, str]) -> str | None:
    scheme, _, token = headers.get("authorization", "").partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def match_digest(token: str | None, digests: Sequence[bytes]) -> int:
    """Index of the digest ``token`` hashes to (-1: none); compares with every one."""
    presented = hashlib.sha256((token or "").encode()).hexdigest().encode()
    found = -1
    for i, d in enumerate(digests):
        if hmac.compare_digest(presented, d) and token is not None:
            found = i
    return found


class Tenancy:
    """The tenants of one router process (empty: tenancy off, nothing changes)."""

    def __init__(
        self,
        tenants: Sequence[Tenant],
        salt_secret: str | None,
        security: SecuritySettings,
        admin_keys: Sequence[str] = (),
        admin_key_sha256: Sequence[str] = (),
    ) -> None:
        self.tenants = list(tenants)
        self.security = security
        secret = (salt_secret or "").encode()
        self._digests = [(t.key_sha256 or sha256_hex(t.key or "")).encode() for t in tenants]
        self._contexts = [
            TenantContext(
                t.name,
                frozenset(t.models),
                hmac.new(
                    secret, _SALT_CONTEXT + (SHARED if t.share_cache else t.name).encode(), "sha256"
                ).hexdigest(),
                t,
            )
            for t in tenants
        ]
        self._by_name = {c.name: c for c in self._contexts}
        self._admin = [d.encode() for d in admin_key_sha256] + [
            sha256_hex(k).encode() for k in admin_keys
        ]
        self._header = security.tenant_header
        self._networks: list[Network] = [
            ipaddress.ip_network(n, strict=False) for n in security.tenant_header_networks
        ]

    @property
    def enabled(self) -> bool:
        return bool(self._contexts)

    @property
    def guarded(self) -> bool:
        """Introspection is guarded: tenants or admin keys are configured."""
        return self.enabled or bool(self._admin)

    def context(self, name: str) -> TenantContext | None:
        return self._by_name.get(name)

    def _trusted_peer(self, client: tuple[str, int] | Sequence[object] | None) -> bool:
        if not self._networks or not client:
            return False
        try:
            addr = ipaddress.ip_address(str(client[0]))
        except ValueError:  # a unix socket or a test client name
            return False
        return any(addr in net for net in self._networks)

    def identify(
        self, headers: Mapping[str, str], client: tuple[str, int] | Sequence[object] | None
    ) -> TenantContext | None:
        """The request's tenant (None when tenancy is off); 401 :class:`RouterError`."""
        if not self._contexts:
            return None
        if self._header is not None:
            named = headers.get(self._header)
            if named is not None and self._trusted_peer(client):
                ctx = self._by_name.get(named.strip())
                if ctx is None:
                    raise unauthorized("unknown tenant in the trusted tenant header")
                return ctx
        i = match_digest(bearer(headers), self._digests)
        if i < 0:
            raise unauthorized()
        return self._contexts[i]

    def is_admin(self, headers: Mapping[str, str]) -> bool:
        return bool(self._admin) and match_digest(bearer(headers), self._admin) >= 0
