"""The candidates of a request: the healthy pods serving its model (within a front's
restriction), and, when there are none, the error saying why: 404 ``model_not_found``
for a model no pod serves, 503 when its pods are unhealthy, not discovered yet or have
not reported their models."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

from router.decision.request import Kind
from router.errors import RouterError, bad_request
from router.fleet.pods import PodRegistry, PodState


def candidates(
    registry: PodRegistry, model: str, only: Collection[str] | None = None
) -> list[PodState]:
    """The healthy pods serving ``model`` (``only``: among these names); raises the
    :class:`RouterError` saying why there are none."""
    pods = registry.candidates(model)
    if pods and only is not None:  # a front's restriction (an endpoint picker's subset hint)
        pods = [p for p in pods if p.name in only]
        if not pods:
            raise RouterError(
                503,
                f"no healthy pod serving model {model!r} is among the allowed endpoints",
                reason="no_pod_in_subset",
                param="model",
            )
    if pods:
        return pods
    every = registry.all()
    if any(model in p.models for p in every):
        raise RouterError(
            503,
            f"no healthy pod serves model {model!r} right now{_why_not(every)}",
            reason="no_healthy_pod",
            param="model",
        )
    if not every:
        raise RouterError(
            503,
            "no pods discovered yet: check the discovery settings (discovery.kind and "
            "its pods, hostname or selector)",
            reason="no_pods",
            param="model",
        )
    if not any(p.models for p in every):  # none has told us what it serves
        raise RouterError(
            503,
            f"none of the {len(every)} pods has reported its models yet{_why_not(every)}",
            reason="no_healthy_pod",
            param="model",
        )
    served = ", ".join(sorted(registry.served_models())) or "none"
    raise RouterError(
        404,
        f"the model {model!r} does not exist; served models: {served}",
        reason="model_not_found",
        param="model",
    )


def only_model(registry: PodRegistry, kind: Kind, model: Any) -> str:
    """The model of a body without one: a passthrough or Responses request
    (``/tokenize``, ``/v1/responses`` and the like, where vLLM makes ``model``
    optional) goes to the one model served."""
    if (kind == "passthrough" or kind == "responses") and model is None:
        served = registry.served_models()
        if len(served) == 1:
            return next(iter(served))
        raise bad_request(
            f"'model' is required: {len(served)} models are served", "missing_model", "model"
        )
    raise bad_request("'model' is required and must be a string", "missing_model", "model")


def _why_not(pods: Sequence[PodState]) -> str:
    """``"; pod-a: <its last problem>"`` for the first pod with a known problem."""
    for p in pods:
        if p.problem:
            return f"; {p.name}: {p.problem}"
    return ""
