"""``approx_prefix``: the router-side baseline that guesses cache state from its own
routing history, with no KV events (SGLang router's ``cache_aware`` policy, GIE's
approximate prefix plugin).

State: per pod, an approximate tree of the block keys *routed* there — a
:class:`scoring.simcache.PrefixCache` (LRU with prefix closure) of at most
``capacity_tokens_per_pod // block_size`` blocks.  Load = router-tracked ``inflight``
(SGLang's running queue).  For each request::

    imbalanced = (max_load - min_load) > balance_abs_threshold
                 and max_load > balance_rel_threshold * min_load
    if imbalanced:                     -> the pod with the fewest in-flight requests
    else:
        ratio = max_pod matched_blocks(pod) / len(block_keys)
        if ratio > cache_threshold:    -> the pod with that longest match
        else:                          -> the pod with the smallest tree
    on_routed: insert the request's block keys into the chosen pod's tree

Ties (equal load, equal match, equal tree size) go to the less loaded pod, then a seeded
random draw.  SGLang matches characters of text; we match block keys of tokens, which
is what the index sees too.  Nothing ever removes a block from a tree except its own LRU
bound: the tree does not know what the engine evicted — that is the point of the
baseline.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from pydantic import Field

from scoring.policies.base import Decision, PodView, Policy, PolicyParams, RouteRequest
from scoring.policies.select import lowest, require_candidates
from scoring.simcache import PrefixCache


class ApproxPrefixParams(PolicyParams):
    cache_threshold: float = Field(default=0.3, ge=0.0, le=1.0)
    balance_abs_threshold: int = Field(default=64, ge=0)
    balance_rel_threshold: float = Field(default=1.5, ge=1.0)
    capacity_tokens_per_pod: int = Field(
        default=2_000_000, gt=0, description="bound of each pod's tree, in tokens"
    )
    seed: int = 0


class ApproxPrefixPolicy(Policy):
    name = "approx_prefix"
    Params = ApproxPrefixParams

    def __init__(self, params: PolicyParams | None = None) -> None:
        super().__init__(params)
        assert isinstance(self.params, ApproxPrefixParams)
        self._p: ApproxPrefixParams = self.params
        self._rng = random.Random(self._p.seed)
        self._trees: dict[str, PrefixCache] = {}

    def _tree(self, pod: str, block_size: int) -> PrefixCache:
        tree = self._trees.get(pod)
        if tree is None:
            tree = PrefixCache(max(1, self._p.capacity_tokens_per_pod // max(1, block_size)))
            self._trees[pod] = tree
        return tree

    def tree_blocks(self, pod: str) -> int:
        """Blocks currently in ``pod``'s approximate tree."""
        tree = self._trees.get(pod)
        return len(tree) if tree is not None else 0

    def _draw(self, pods: list[PodView]) -> PodView:
        """The least loaded of ``pods`` (in-flight requests), ties drawn at random."""
        return lowest(pods, [p.inflight for p in pods], self._rng)[0]

    def pick(self, request: RouteRequest, pods: Sequence[PodView]) -> Decision:
        require_candidates(self.name, pods)
        p = self._p
        loads = [pod.inflight for pod in pods]
        max_load, min_load = max(loads), min(loads)
        imbalanced = (
            max_load - min_load > p.balance_abs_threshold
            and max_load > p.balance_rel_threshold * min_load
        )
        keys = request.block_keys
        matched = {
            pod.pod: (self._trees[pod.pod].match(keys) if pod.pod in self._trees else 0)
            for pod in pods
        }
        ratio = max(matched.values()) / len(keys) if keys else 0.0
        if imbalanced:
            chosen, reason = self._draw(list(pods)), "imbalanced: shortest queue"
        elif ratio > p.cache_threshold:
            best = max(matched.values())
            chosen = self._draw([pod for pod in pods if matched[pod.pod] == best])
            reason = "prefix match"
        else:
            smallest = min(self.tree_blocks(pod.pod) for pod in pods)
            chosen = self._draw([pod for pod in pods if self.tree_blocks(pod.pod) == smallest])
            reason = "low match: smallest tree"
        return Decision(
            pod=chosen.pod,
            scores={name: (n / len(keys) if keys else 0.0) for name, n in matched.items()},
            detail={"reason": reason, "match_ratio": ratio, "imbalanced": imbalanced},
        )

    def on_routed(self, request: RouteRequest, pod: str) -> None:
        if request.block_keys:
            self._tree(pod, request.block_size).insert(request.block_keys)

    def on_pod_removed(self, pod: str) -> None:
        self._trees.pop(pod, None)
