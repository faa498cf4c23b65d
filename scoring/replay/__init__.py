"""Offline replay: a trace -> simulated pods in virtual time -> hit rate / TTFT per policy.

The replay drives the very policy objects the live router uses (built with
:func:`scoring.policies.build_policy`), calling ``pick`` / ``on_routed`` /
``on_complete`` exactly as the router does, with :class:`~scoring.policies.PodView`\\ s
built from the simulated pods' true cache contents and the load the router would know.
"""

from scoring.replay.engine import PolicyRun, replay_policy
from scoring.replay.simpod import FleetConfig, ReplayConfigError
from scoring.replay.trace import Trace, TraceRequest, load_trace

__all__ = [
    "FleetConfig",
    "PolicyRun",
    "ReplayConfigError",
    "Trace",
    "TraceRequest",
    "load_trace",
    "replay_policy",
]
