"""A Kubernetes Pod object -> its endpoints (:class:`PodSpec`), for :mod:`router.fleet.discovery`.

Which pods count (:func:`pod_is_ready`) and what each one is (:func:`pod_specs`): its
port(s), KV-event and replay endpoints, models and prefill/decode role, from its
annotations and labels, else the discovery settings.

As GIE's endpoint picker does (``pkg/epp/datastore/datastore.go``, now
``pkg/lwepp/datastore/datastore.go``: ``IsPodReady``, ``extractActivePorts``), a pod
counts when Ready and not terminating (kvroute also wants its ``podIP``, which GIE copies
even when empty), and its endpoints are the target ports that its
``inference.networking.k8s.io/active-ports`` annotation lists (all of them without the
annotation); a rank keeps its index among the target ports.  GIE does not look at the
containers' declared ports.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from router.fleet.dns import host_in_url as _host
from router.fleet.dns import zmq_endpoint as _endpoint
from router.fleet.pods import PodSpec
from router.fleet.roles import Role, parse_role, parse_role_map, role_overrides

if TYPE_CHECKING:
    from router.fleet.k8s import K8sDiscoverySettings


#: GIE's annotation: the comma-separated target ports of a pod that take traffic
ACTIVE_PORTS_ANNOTATION = "inference.networking.k8s.io/active-ports"

_LEADING_INT = re.compile(r"[+-]?[0-9]+")


def active_ports(ann: Mapping[str, str], ports: list[int]) -> list[int]:
    """The ``ports`` that :data:`ACTIVE_PORTS_ANNOTATION` lists (all without it).

    As GIE's ``extractActivePorts``: each comma-separated entry is read as Go's
    ``fmt.Sscanf("%d")`` reads it (its leading integer), and entries that do not
    parse, are not positive or are not among ``ports`` are ignored; an annotation
    that lists none of them leaves the pod no endpoint."""
    raw = ann.get(ACTIVE_PORTS_ANNOTATION)
    if raw is None:
        return ports
    listed: set[int] = set()
    for entry in str(raw).split(","):
        m = _LEADING_INT.match(entry.strip())
        if m:
            listed.add(int(m.group()))
    return [p for p in ports if p > 0 and p in listed]


def pod_is_ready(pod: Mapping[str, Any]) -> bool:
    """Ready=True condition, a podIP, and not being deleted."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    if meta.get("deletionTimestamp") or not status.get("podIP"):
        return False
    for cond in status.get("conditions") or []:
        if cond.get("type") == "Ready":
            return cond.get("status") == "True"
    return False


def _offset(port: int | None, rank: int, what: str) -> int | None:
    """``port + rank`` (vLLM's data-parallel rank ``rank`` publishes there)."""
    if port is None:
        return None
    if port + rank > 65535:
        raise ValueError(f"the {what} port of rank {rank} would be {port + rank} (> 65535)")
    return port + rank


def _port(ann: Mapping[str, str], key: str, default: int | None) -> int | None:
    raw = ann.get(key)
    if raw is None:
        return default
    try:
        port = int(raw)
        if not 0 < port < 65536:
            raise ValueError
    except ValueError:
        raise ValueError(f"annotation {key}={raw!r} is not a port number") from None
    return port


def pod_specs(pod: Mapping[str, Any], s: K8sDiscoverySettings) -> list[PodSpec]:
    """The PodSpecs of a Ready pod object: one, or with several ``ports`` one per
    port (``<pod>-rank-<i>``, as GIE's picker names them; rank i's KV events on
    ``events_port + i``, as vLLM's data-parallel ranks publish them), only on the
    ports that are active (:func:`active_ports`; a rank keeps its index among all
    the ports); ``ValueError`` on a bad annotation or when no port is active."""
    meta = pod.get("metadata") or {}
    name = meta["name"]
    ann = meta.get("annotations") or {}
    ip = pod["status"]["podIP"]
    annotated = _port(ann, s.port_annotation, None)
    ports = [annotated] if annotated is not None else (s.ports or [s.port])
    events = _port(ann, s.events_port_annotation, s.events_port)
    replay = _port(ann, s.replay_port_annotation, s.replay_port)
    models = ann.get(s.models_annotation)
    model_list = [m.strip() for m in models.split(",") if m.strip()] if models else s.models
    role, roles = roles_of(meta, s)
    active = active_ports(ann, ports)
    if not active:
        raise ValueError(
            f"no port of {ports} is active "
            f"({ACTIVE_PORTS_ANNOTATION}={ann.get(ACTIVE_PORTS_ANNOTATION)!r})"
        )
    specs = []
    for rank, port in enumerate(ports):
        if port not in active:
            continue
        specs.append(
            PodSpec(
                name=name if len(ports) == 1 else f"{name}-rank-{rank}",
                url=f"{s.scheme}://{_host(ip)}:{port}",
                events_endpoint=_endpoint(ip, _offset(events, rank, "events")),
                replay_endpoint=_endpoint(ip, _offset(replay, rank, "replay")),
                models=tuple(model_list),
                role=role,
                roles=role_overrides(roles),
            )
        )
    return specs


def roles_of(meta: Mapping[str, Any], s: K8sDiscoverySettings) -> tuple[Role, dict[str, Role]]:
    """The pod's role (first of ``role_keys`` among labels, then annotations) and
    per-model roles; :class:`RoleError` (a ValueError: the pod is skipped) on a bad
    value."""
    labels = meta.get("labels") or {}
    ann = meta.get("annotations") or {}
    role = s.role
    for source in (labels, ann):
        found = next((k for k in s.role_keys if k in source), None)
        if found is not None:
            role = parse_role(str(source[found]), found)
            break
    raw = ann.get(s.roles_annotation)
    return role, parse_role_map(str(raw), s.roles_annotation) if raw else {}
