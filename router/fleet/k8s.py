"""Kubernetes pod discovery: list + watch the Pods matching a label selector through the
API server's REST API (service-account token and CA), keeping only *Ready* pods with a
``podIP``; re-list on ``410 Gone``.  The settings are the ``discovery.k8s`` section
(:class:`router.fleet.discovery.DiscoverySettings`); a pod object becomes endpoints in
:mod:`router.fleet.k8s_endpoints`."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, field_validator

from router.fleet.dns import host_in_url as _host
from router.fleet.k8s_endpoints import pod_is_ready, pod_specs
from router.fleet.pods import PodRegistry, PodSpec
from router.fleet.roles import Role
from router.logs import RateLimitedLog

log = logging.getLogger(__name__)

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"


class DiscoveryError(RuntimeError):
    """Discovery cannot run as configured (the message says what is missing)."""


class K8sDiscoverySettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    namespace: str | None = Field(
        default=None, description="namespace (default: the service account's own namespace)"
    )
    label_selector: str = Field(min_length=1, description="e.g. app=vllm")
    port: int = Field(default=8000, ge=1, le=65535, description="HTTP port unless annotated")
    ports: list[int] = Field(
        default_factory=list,
        max_length=8,
        description="several HTTP ports per pod, one endpoint each (an InferencePool's "
        "targetPorts): rank i at ports[i], named <pod>-rank-<i>, its KV events on "
        "events_port + i and replay on replay_port + i (vLLM's data-parallel ranks); "
        "replaces port unless annotated",
    )
    scheme: Literal["http", "https"] = Field(default="http", description="pods' URL scheme")
    events_port: int | None = Field(default=None, ge=1, le=65535, description="unless annotated")
    replay_port: int | None = Field(default=None, ge=1, le=65535, description="unless annotated")
    models: list[str] = Field(default_factory=list, description="unless annotated")
    port_annotation: str = Field(default="kvroute.io/port", description="annotation: HTTP port")
    events_port_annotation: str = Field(
        default="kvroute.io/events-port", description="annotation: KV-event PUB port"
    )
    replay_port_annotation: str = Field(
        default="kvroute.io/replay-port", description="annotation: replay ROUTER port"
    )
    models_annotation: str = Field(
        default="kvroute.io/models", description="annotation: comma-separated served models"
    )
    role: Role = Field(default="both", description="P/D role of a pod that names none")
    role_keys: list[str] = Field(
        default_factory=lambda: ["kvroute.io/role", "llm-d.ai/role"],
        description="labels, then annotations, naming a pod's P/D role (first found wins)",
    )
    roles_annotation: str = Field(
        default="kvroute.io/roles", description="annotation: per-model roles, m1=prefill,..."
    )
    api_server: str | None = Field(
        default=None,
        description="API server base URL (default https://$KUBERNETES_SERVICE_HOST:"
        "$KUBERNETES_SERVICE_PORT)",
    )
    token_file: str = Field(
        default=f"{SA_DIR}/token", description="service-account token (re-read)"
    )
    ca_file: str = Field(default=f"{SA_DIR}/ca.crt", description="API server CA bundle")
    namespace_file: str = Field(
        default=f"{SA_DIR}/namespace", description="default namespace source"
    )
    watch_timeout_s: int = Field(default=300, ge=1, description="server-side timeout of one watch")
    retry_s: float = Field(default=2.0, gt=0, description="pause after a failed list/watch")

    @field_validator("ports")
    @classmethod
    def _distinct_ports(cls, ports: list[int]) -> list[int]:
        if len(set(ports)) != len(ports):
            raise ValueError(f"discovery.k8s.ports lists a port twice: {ports}")
        bad = [p for p in ports if not 0 < p < 65536]
        if bad:
            raise ValueError(f"discovery.k8s.ports: {bad} not port numbers (1-65535)")
        return ports


class _Gone(Exception):
    """The watch's resourceVersion is too old: re-list."""


class K8sDiscovery:
    """List + watch Pods through the Kubernetes API server."""

    def __init__(self, settings: K8sDiscoverySettings, *, client: httpx.AsyncClient | None = None):
        self.settings = settings
        self.namespace = settings.namespace or self._read_namespace()
        self.base_url = settings.api_server or self._api_server_from_env()
        self._client = client
        self._pods: dict[str, dict[str, Any]] = {}
        self.lists = 0
        self.relists_on_gone = 0
        self.watch_events = 0
        self.errors = 0
        self.skipped: dict[str, str] = {}
        self._log = RateLimitedLog(log)  # one line per cause per 10 s, not per event

    def _read_namespace(self) -> str:
        try:
            return Path(self.settings.namespace_file).read_text().strip()
        except OSError:
            raise DiscoveryError(
                "discovery.k8s.namespace is not set and "
                f"{self.settings.namespace_file} cannot be read"
            ) from None

    @staticmethod
    def _api_server_from_env() -> str:
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise DiscoveryError(
                "discovery.k8s.api_server is not set and KUBERNETES_SERVICE_HOST is empty "
                "(not running in a cluster?)"
            )
        return f"https://{_host(host)}:{port}"

    def _headers(self) -> dict[str, str]:
        # re-read every time: projected service-account tokens rotate
        try:
            token = Path(self.settings.token_file).read_text().strip()
        except OSError:
            return {}
        return {"Authorization": f"Bearer {token}"} if token else {}

    def _make_client(self) -> httpx.AsyncClient:
        verify: Any = True
        if self.base_url.startswith("https://"):
            if Path(self.settings.ca_file).is_file():
                verify = ssl.create_default_context(cafile=self.settings.ca_file)
            else:  # outside a pod, or no service account mounted
                log.warning(
                    "discovery.k8s.ca_file %s does not exist: the API server at %s is "
                    "verified against the system trust store",
                    self.settings.ca_file,
                    self.base_url,
                )
        return httpx.AsyncClient(
            base_url=self.base_url,
            verify=verify,
            timeout=httpx.Timeout(10.0, read=self.settings.watch_timeout_s + 30.0),
        )

    @property
    def _path(self) -> str:
        return f"/api/v1/namespaces/{self.namespace}/pods"

    # -- pod -> spec -------------------------------------------------------------------

    def spec_of(self, pod: Mapping[str, Any]) -> PodSpec:
        """The PodSpec of a Ready pod object (its first port's); ``ValueError`` on a
        bad annotation."""
        return self.specs_of(pod)[0]

    def specs_of(self, pod: Mapping[str, Any]) -> list[PodSpec]:
        """The PodSpecs of a Ready pod object (:func:`router.fleet.k8s_endpoints.pod_specs`)."""
        return pod_specs(pod, self.settings)

    def current_specs(self) -> list[PodSpec]:
        specs: list[PodSpec] = []
        for name, pod in sorted(self._pods.items()):
            if not pod_is_ready(pod):
                continue
            try:
                specs.extend(self.specs_of(pod))
            except (KeyError, ValueError) as exc:
                if self.skipped.get(name) != str(exc):
                    log.warning("k8s discovery: pod %s skipped: %s", name, exc)
                self.skipped[name] = str(exc)
        return specs

    # -- list + watch ------------------------------------------------------------------

    async def list_pods(self, client: httpx.AsyncClient) -> str:
        """Replace the pod map with a fresh list; return its resourceVersion."""
        r = await client.get(
            self._path,
            params={"labelSelector": self.settings.label_selector},
            headers=self._headers(),
        )
        r.raise_for_status()
        body = r.json()
        if not isinstance(body, dict):
            raise ValueError(f"pod list is not a JSON object: {str(body)[:200]}")
        pods: dict[str, dict[str, Any]] = {}
        for item in body.get("items") or []:
            name = (item.get("metadata") or {}).get("name") if isinstance(item, dict) else None
            if not isinstance(name, str) or not name:
                self.errors += 1
                self._log.warning(
                    "no_name", "k8s discovery: list item without metadata.name skipped"
                )
                continue
            pods[name] = item
        self._pods = pods
        self.lists += 1
        return str((body.get("metadata") or {}).get("resourceVersion") or "")

    async def _watch_lines(self, client: httpx.AsyncClient, rv: str) -> AsyncIterator[str]:
        params = {
            "labelSelector": self.settings.label_selector,
            "watch": "1",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(self.settings.watch_timeout_s),
        }
        if rv:
            params["resourceVersion"] = rv
        async with client.stream("GET", self._path, params=params, headers=self._headers()) as r:
            if r.status_code == 410:
                raise _Gone()
            r.raise_for_status()
            async for line in r.aiter_lines():
                if line.strip():
                    yield line

    def apply_watch_event(self, ev: Mapping[str, Any]) -> str | None:
        """Apply one watch event to the pod map; return the new resourceVersion."""
        if not isinstance(ev, Mapping) or not isinstance(ev.get("object"), Mapping):
            raise ValueError(f"watch event is not {{type, object}}: {str(ev)[:200]}")
        kind = ev.get("type")
        obj = ev["object"]
        if kind == "ERROR":
            if obj.get("code") == 410:
                raise _Gone()
            raise RuntimeError(f"watch error: {obj.get('message') or obj}")
        meta = obj.get("metadata") or {}
        rv = meta.get("resourceVersion")
        if kind == "BOOKMARK":
            return str(rv) if rv else None
        name = meta.get("name")
        if not name:
            return str(rv) if rv else None
        self.watch_events += 1
        if kind == "DELETED":
            self._pods.pop(name, None)
        elif kind in ("ADDED", "MODIFIED"):
            self._pods[name] = dict(obj)
        return str(rv) if rv else None

    async def run(self, registry: PodRegistry) -> None:
        client = self._client or self._make_client()
        try:
            while True:
                try:
                    rv = await self.list_pods(client)
                    registry.set_pods(self.current_specs())
                    while True:  # watch until the resourceVersion expires
                        async for line in self._watch_lines(client, rv):
                            try:
                                new_rv = self.apply_watch_event(json.loads(line))
                            except ValueError as exc:  # JSONDecodeError included
                                self.errors += 1
                                self._log.warning(
                                    "bad_line", "k8s discovery: bad watch line skipped: %s", exc
                                )
                                continue
                            if new_rv:
                                rv = new_rv
                            registry.set_pods(self.current_specs())
                except _Gone:
                    self.relists_on_gone += 1
                    log.info("k8s discovery: resourceVersion expired (410 Gone): re-listing")
                except Exception as exc:  # never let discovery die: log, count, retry
                    self.errors += 1
                    self._log.warning(
                        ("retry", type(exc).__name__),
                        "k8s discovery: %s: %s; retrying in %gs",
                        type(exc).__name__,
                        exc,
                        self.settings.retry_s,
                    )
                    await asyncio.sleep(self.settings.retry_s)
        finally:
            if self._client is None:
                await client.aclose()
