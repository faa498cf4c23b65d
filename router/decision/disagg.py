"""The prefill/decode step of the decision (issue #12): for a model whose candidates have
roles, which decode pod, which prefill pod (or none), and the orders to retry them in.

A fleet where every candidate of the model is ``both`` (no roles: the default) never
reaches :class:`PDStep`'s decision: :meth:`PDStep.plan` returns None and the request is
decided as it always was, by the configured policy over every candidate.

With roles, the candidates split into two pools (router/fleet/roles.py): the *prefill
pool* (role ``prefill`` or ``both``) and the *decode pool* (``decode`` or ``both``).  Each
pool's views are the views of its own pods, built from the one index lookup of the
request's block keys: a :class:`~scoring.policies.base.PodView` holds only its pod's
index entries, so a decode pod's cache (the blocks it pulled and then published as
``BlockStored``) never enters a prefill pod's view (sglang#25184).  A ``both`` pod is in
both pools with its own view.  :class:`scoring.pd.PDRouter` decides:

* the **decode pod** (lowest decode score) -- the request's pod, always: a ``prefill``
  pod never takes a whole request, so the ranking a front retries along is the decode
  pool ordered by decode score;
* the **prefill pod** -- the prefill policy (``pd.prefill_policy``, default the
  router's ``policy``; its own instance, so its bookkeeping sees only prefill traffic)
  over the prefill pool minus the decode pod; its ranking is the order in which the
  proxy tries prefill pods;
* **split or direct** -- ``short`` (fewer than ``min_uncached_tokens`` for the decode pod
  to compute), ``local_faster``, ``no_prefill_pod``, or ``split``.

Nothing is counted here (``POST /v1/route`` decides without sending): the proxy counts
the decision it sends (router/proxy/disagg.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from router.decision.request import rank
from router.errors import RouterError
from router.fleet.pods import PodState
from router.fleet.roles import can_decode, can_prefill
from scoring.pd import PDDecision, PDParams, PDRouter
from scoring.policies import build_policy
from scoring.policies.base import Decision, PodView, RouteRequest


class PDSettings(BaseModel):
    """Prefill/decode disaggregation (docs/pd.md); in effect only for models whose pods
    have roles (``role: prefill`` / ``decode``)."""

    model_config = ConfigDict(extra="forbid")

    prefill_policy: str | None = Field(
        default=None,
        description="policy choosing the prefill pod among the prefill pool (null: the "
        "router's `policy`); round_robin is what vLLM's toy proxy does",
    )
    prefill_policy_params: dict[str, Any] = Field(
        default_factory=dict, description="the prefill policy's parameters"
    )
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="scoring.pd.PDParams: min_uncached_tokens (256), always_split, "
        "prefill_rate_tokens_per_s, transfer_s_per_block, ... (scoring/policies/README.md)",
    )
    kv_lease_s: float = Field(
        default=30.0,
        gt=0.0,
        description="how long a prefill pod holds a request's blocks for the decode pod "
        "(vLLM's kv_lease_duration, 30 s): a decode pod that could not be reached is "
        "replaced by another with the same kv_transfer_params within it, by a plain "
        "request after it",
    )
    prefill_pod_header: str = Field(
        default="x-kvroute-prefill-pod",
        description="response header naming the prefill pod of a disaggregated request",
    )

    @field_validator("params")
    @classmethod
    def _params(cls, v: dict[str, Any]) -> dict[str, Any]:
        PDParams.model_validate(v)  # unknown or bad fields fail the settings
        return v

    @field_validator("prefill_policy")
    @classmethod
    def _policy(cls, v: str | None) -> str | None:
        from scoring.policies.registry import available_policies

        if v is not None and v not in available_policies():
            raise ValueError(f"unknown policy {v!r}; available: {', '.join(available_policies())}")
        return v

    @field_validator("prefill_pod_header")
    @classmethod
    def _header(cls, v: str) -> str:
        if not v or any(c.isspace() or c == ":" for c in v):
            raise ValueError(f"not a valid HTTP header name: {v!r}")
        return v.lower()


@dataclass(slots=True)
class PDPlan:
    """A request of a model with roles: the P/D decision and the orders to try pods in."""

    decision: PDDecision
    #: decode-capable pods, best (the decode pod) first: the request's ranking
    decode_ranking: list[str]
    #: prefill pods to try, best first (empty unless the request is split)
    prefill_ranking: list[str]
    #: every candidate's role for the model
    roles: dict[str, str]

    @property
    def split(self) -> bool:
        return self.decision.prefill_pod is not None

    def as_decision(self) -> Decision:
        """The decision a front sees: the decode pod, by decode score."""
        d = self.decision
        return Decision(
            d.decode_pod,
            d.decode_scores,
            lower_is_better=True,
            detail={"pd_reason": d.reason, "prefill_pod": d.prefill_pod},
        )


class PDStep:
    """Runs :class:`~scoring.pd.PDRouter` for models whose candidates have roles."""

    def __init__(
        self, settings: PDSettings, default_policy: str, default_params: Mapping[str, Any]
    ) -> None:
        name = settings.prefill_policy or default_policy
        params = settings.prefill_policy_params
        if settings.prefill_policy is None:
            params = dict(default_params)
        self.prefill_policy_name = name
        self.router = PDRouter(build_policy(name, params), PDParams.model_validate(settings.params))

    def plan(
        self,
        route: RouteRequest,
        pods: Sequence[PodState],
        views: Mapping[str, PodView],
    ) -> PDPlan | None:
        """The P/D plan for ``route`` (None: no candidate has a role, decide as usual)."""
        roles = [(p.name, p.role_for(route.model)) for p in pods]
        if all(role == "both" for _, role in roles):
            return None
        prefill = [views[n] for n, role in roles if can_prefill(role)]
        decode = [views[n] for n, role in roles if can_decode(role)]
        if not decode:
            raise RouterError(
                503,
                f"no healthy decode pod (role decode or both) serves model {route.model!r}: "
                f"only prefill pods {', '.join(n for n, _ in roles)}",
                reason="no_decode_pod",
                param="model",
            )
        decided = self.router.pick(route, prefill, decode)
        scores = decided.decode_scores
        others = sorted(
            (v.pod for v in decode if v.pod != decided.decode_pod), key=lambda n: scores[n]
        )
        prefill_ranking: list[str] = []
        if decided.prefill is not None and decided.prefill_pod is not None:
            pool = [v.pod for v in prefill if v.pod != decided.decode_pod]
            prefill_ranking = rank(decided.prefill, pool)
        return PDPlan(decided, [decided.decode_pod, *others], prefill_ranking, dict(roles))

    def on_pod_removed(self, pod: str) -> None:
        self.router.on_pod_removed(pod)
