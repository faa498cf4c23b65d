"""A Kubernetes Pod object -> its endpoints (:class:`PodSpec`), for :mod:`router.fleet.discovery`.

Which pods count (:func:`pod_is_ready`) and what each one is (:func:`pod_specs`): its
port(s), KV-event and replay endpoints, models and prefill/decode role, from its
annotations and labels, else the discovery settings.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from router.fleet.dns import host_in_url as _host
from router.fleet.dns import zmq_endpoint as _endpoint
from router.fleet.pods import PodSpec
from router.fleet.roles import Role, parse_role, parse_role_map, role_overrides

if TYPE_CHECKING:
    from router.fleet.discovery import K8sDiscoverySettings


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
    ``events_port + i``, as vLLM's data-parallel ranks publish them);
    ``ValueError`` on a bad annotation."""
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
    specs = []
    for rank, port in enumerate(ports):
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
