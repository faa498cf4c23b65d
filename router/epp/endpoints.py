"""Pods as the proxy names them: ``ip:port`` endpoints, from the registry's pod URLs.

The proxy routes to an address (Envoy's ``ORIGINAL_DST`` cluster, its ``override_host``
policy, GKE's load balancer), so each pod's URL must carry an IP literal: Kubernetes
and DNS discovery give pod IPs; a static pod named by a host name cannot be picked
(it is left out, logged once, counted in ``kvroute_epp_unaddressable_pods``).  IPv6
endpoints are written ``[addr]:port``.

:class:`Endpoints` keeps both directions (pod -> endpoint for the pick, endpoint -> pod
for the served-endpoint feedback) and follows the registry.  A subset hint entry
without a port (``10.0.0.7``) allows every port of that IP, as GIE's reference picker
does.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Collection, Iterable
from urllib.parse import urlsplit

from router.fleet.pods import PodRegistry, PodSpec

log = logging.getLogger(__name__)

_DEFAULT_PORTS = {"http": 80, "https": 443}


def endpoint_of(url: str) -> str | None:
    """``ip:port`` of a pod URL (None when the host is not an IP literal)."""
    parts = urlsplit(url)
    host = parts.hostname
    if not host:
        return None
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    try:
        port = parts.port or _DEFAULT_PORTS.get(parts.scheme)
    except ValueError:
        return None
    if port is None:
        return None
    return f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"


def _host(endpoint: str) -> str:
    """The IP part of ``ip:port`` / ``[v6]:port`` / a bare IP."""
    if endpoint.startswith("["):
        return endpoint[1:].split("]", 1)[0]
    if endpoint.count(":") == 1:
        return endpoint.rsplit(":", 1)[0]
    return endpoint  # a bare IPv4, or a bare IPv6 address


class Endpoints:
    """pod name <-> ``ip:port``, kept in step with a :class:`PodRegistry`."""

    def __init__(self, registry: PodRegistry) -> None:
        self._of_pod: dict[str, str] = {}
        self._pod_of: dict[str, str] = {}
        #: pods whose URL names no IP (never picked)
        self.unaddressable: set[str] = set()
        registry.subscribe(self._on_pod)

    def _on_pod(self, name: str, spec: PodSpec | None) -> None:
        old = self._of_pod.pop(name, None)
        if old is not None and self._pod_of.get(old) == name:
            del self._pod_of[old]
        self.unaddressable.discard(name)
        if spec is None:
            return
        endpoint = endpoint_of(spec.url)
        if endpoint is None:
            self.unaddressable.add(name)
            log.warning(
                "pod %s: its URL %s names no IP address; an endpoint picker cannot send "
                "requests there (use Kubernetes or DNS discovery, or an IP in the URL)",
                name,
                spec.url,
            )
            return
        self._of_pod[name] = endpoint
        self._pod_of[endpoint] = name

    def of(self, pod: str) -> str | None:
        return self._of_pod.get(pod)

    def pod(self, endpoint: str) -> str | None:
        return self._pod_of.get(endpoint)

    def join(self, pods: Iterable[str], limit: int) -> str:
        """The first ``limit`` addressable pods of ``pods`` as ``ip:port,ip:port``."""
        out: list[str] = []
        for p in pods:
            e = self._of_pod.get(p)
            if e is not None:
                out.append(e)
                if len(out) >= limit:
                    break
        return ",".join(out)

    def allowed(self, subset: Collection[str]) -> set[str]:
        """The pods a subset hint allows (entries ``ip:port``, or a bare IP for every
        port of it)."""
        exact = set(subset)
        hosts = {e for e in exact if ":" not in e or (e.count(":") > 1 and not e.startswith("["))}
        out = set()
        for endpoint, pod in self._pod_of.items():
            if endpoint in exact or _host(endpoint) in hosts:
                out.add(pod)
        return out

    def addressable(self) -> set[str]:
        return set(self._of_pod)
