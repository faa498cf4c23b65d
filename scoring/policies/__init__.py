"""Routing policies: one per module, built by name from typed parameters."""

from scoring.policies.base import (
    Decision,
    PodView,
    Policy,
    PolicyParams,
    RouteRequest,
)
from scoring.policies.registry import available_policies, build_policy

__all__ = [
    "Decision",
    "PodView",
    "Policy",
    "PolicyParams",
    "RouteRequest",
    "available_policies",
    "build_policy",
]
