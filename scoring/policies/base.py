"""The common policy interface shared by the live router and the offline replay.

A policy sees only plain data: the request (its block-key chain and size) and one
:class:`PodView` per candidate pod (index hits + load).  It returns a :class:`Decision`.
It is told when a request it routed finished, so stateful policies (round robin,
approximate prefix trees, session tables) can keep their own bookkeeping.

Observation hooks (default no-ops): :meth:`Policy.on_first_token` (the request's TTFT as
the router measured it) and :meth:`Policy.on_finished` (it was served to the end, with
its output tokens when known), for policies that learn their pods' rates online.  A
policy reads time from :attr:`Policy.clock` (``time.perf_counter`` live); the replay sets
it to its virtual clock, so the same learning code sees simulated time.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict


class PolicyParams(BaseModel):
    """Base of every policy's parameter model: unknown fields are an error."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(slots=True)
class RouteRequest:
    """What a policy knows about one request."""

    request_id: str
    model: str
    prompt_tokens: int
    block_keys: Sequence[int]
    block_size: int
    lora: str | None = None
    session: str | None = None  # session id from a header / body field, if any
    max_tokens: int | None = None


@dataclass(slots=True)
class PodView:
    """What a policy knows about one candidate pod at decision time."""

    pod: str
    #: tier -> leading blocks servable from that tier or faster (see scoring.index.base)
    hits: dict[str, int] = field(default_factory=dict)
    #: requests routed here and not finished (router-tracked, shared across replicas)
    inflight: int = 0
    #: prompt tokens routed here whose prefill has not finished (router-tracked)
    outstanding_prefill_tokens: int = 0
    #: scraped from the pod's /metrics (None when unknown or stale)
    waiting: int | None = None
    running: int | None = None
    kv_usage: float | None = None  # 0..1
    #: blocks the pod's prefix cache holds, all prefixes (the index's count; None when
    #: unknown): where a prefix nobody holds has the most room to stay
    resident_blocks: int | None = None
    #: blocks the pod's KV cache can hold (the engine's ``num_gpu_blocks``; None when
    #: unknown): with ``resident_blocks``, its free room
    capacity_blocks: int | None = None
    #: of ``hits["GPU"]``, the blocks held only by speculative entries: routed to the pod
    #: but not announced by its KV events (``router/decision/learning.py``)
    speculative: int = 0

    def cached_blocks(self, tier: str = "GPU") -> int:
        return self.hits.get(tier, 0)

    def best_cached_blocks(self) -> int:
        return max(self.hits.values(), default=0)


@dataclass(frozen=True, slots=True)
class PodCounters:
    """A pod's engine counters at one scrape of its ``/metrics``, cumulative since the
    engine started (``None``: the pod does not export them)."""

    #: ``vllm:num_requests_running`` (a gauge: now)
    running: int | None = None
    #: ``vllm:inter_token_latency_seconds`` ``_sum`` / ``_count``: each decoded token's
    #: gap to the one before (an engine step, as the request saw it)
    itl_sum_s: float | None = None
    itl_count: float | None = None
    #: ``vllm:request_decode_time_seconds`` ``_sum`` / ``_count``: finished requests'
    #: first token to last
    decode_sum_s: float | None = None
    decode_count: float | None = None


@dataclass(slots=True)
class Decision:
    """The chosen pod and, for explanation, every candidate's score (higher = better)
    or predicted cost (lower = better; ``lower_is_better`` says which)."""

    pod: str
    scores: dict[str, float]
    lower_is_better: bool = False
    detail: dict[str, Any] = field(default_factory=dict)


class NoCandidatesError(ValueError):
    """Raised when a policy is asked to pick among zero pods."""


class Policy(ABC):
    """One routing policy.  Subclasses set ``name`` and ``Params``."""

    name: ClassVar[str]
    Params: ClassVar[type[PolicyParams]]

    def __init__(self, params: PolicyParams | None = None) -> None:
        self.params = params if params is not None else self.Params()
        #: seconds, monotonic: the router's clock live, the replay's virtual clock
        self.clock: Callable[[], float] = time.perf_counter

    @abstractmethod
    def pick(self, request: RouteRequest, pods: Sequence[PodView]) -> Decision:
        """Choose one of ``pods`` (non-empty) for ``request``."""

    def on_routed(self, request: RouteRequest, pod: str) -> None:  # noqa: B027
        """The request was sent to ``pod`` (after any retry)."""

    def on_first_token(self, request: RouteRequest, pod: str, ttft_s: float) -> None:  # noqa: B027
        """The first token of ``request`` came back from ``pod``, ``ttft_s`` after it
        arrived at the router (called before ``on_complete``)."""

    def on_prefill_done(self, request: RouteRequest, pod: str) -> None:  # noqa: B027
        """``request``'s first token has come out of ``pod``, but the router did not see
        it (a JSON answer forwarded as it came): the pod's own count of first tokens
        shows it (scoring/unseen_first_tokens.py).  When, a scrape only bounds, so
        nothing should be learned from it.  Never called for a request that had
        ``on_first_token``; called before ``on_complete``."""

    def on_scraped(self, pod: str, counters: PodCounters) -> None:  # noqa: B027
        """A scrape of ``pod``'s metrics (every ``scrape.interval_s`` live; in the replay
        with JSON answers, at the same cadence in virtual time)."""

    def on_finished(  # noqa: B027
        self, request: RouteRequest, pod: str, output_tokens: int | None
    ) -> None:
        """``request`` was served to its last token by ``pod`` (``output_tokens``
        generated, ``None`` when the router does not know); called just before
        ``on_complete``, never for a failed attempt."""

    def on_complete(self, request: RouteRequest, pod: str) -> None:  # noqa: B027
        """The request finished on ``pod`` (success or failure)."""

    def on_pod_removed(self, pod: str) -> None:  # noqa: B027
        """``pod`` left the fleet."""

    def learned(self) -> dict[tuple[str, str], float]:
        """What the policy has learned from its observations so far, by (quantity,
        model) (``kvroute_policy_learned``; a policy that learns nothing returns ``{}``)."""
        return {}

    def learned_per_pod(self) -> dict[tuple[str, str], float]:
        """What the policy has learned about each pod, by (quantity, pod)
        (``kvroute_policy_pod_learned``; a policy that learns nothing per pod returns
        ``{}``).  A pod the policy forgot (``on_pod_removed``) is left out."""
        return {}

    def rejected_observations(self) -> dict[str, int]:
        """Observations the policy dropped as bad input, by reason
        (``kvroute_policy_rejected_observations_total``)."""
        return {}

    def routed_prefixes(self, keys: Sequence[int], pods: Sequence[str]) -> dict[str, int]:
        """Per pod, the leading blocks of ``keys`` this policy remembers routing there
        (pods with none left out).  The router's stand-in for the index's hits while the
        shared index cannot be read; a policy that remembers nothing returns ``{}``."""
        return {}


def reads_output(policy: Policy) -> bool:
    """Whether ``policy`` has an ``on_finished`` of its own: without one a front neither
    calls the base class's no-op nor reads an answer's output tokens for it."""
    return type(policy).on_finished is not Policy.on_finished
