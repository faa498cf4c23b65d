"""Per pod, the uncached prompt tokens of the routed requests that are still in prefill.

Dynamo's KV router (``active_prefill_tokens``, lib/kv-router/src/sequences/single.rs) and
llm-d's ``inflight-load-producer`` (``InFlightLoad.Tokens``) both charge a worker, from
dispatch until its first token comes back, the *uncached* prompt tokens of every request
they sent there: the prompt minus the prefix the router predicted the worker holds.  A
:class:`~scoring.policies.base.Policy` hears :meth:`on_routed` and :meth:`on_complete`,
not the first token, so :class:`ActivePrefill` reconstructs that moment from
``PodView.outstanding_prefill_tokens`` (router-tracked: whole prompts routed to the pod
whose first token has not come back).  A pod prefills FCFS, so the requests still in
prefill are the newest ones routed there::

    remaining = outstanding_prefill_tokens
    for each live request on the pod, newest first, while remaining > 0:
        take = min(its prompt tokens, remaining)
        active += its predicted uncached tokens * take / its prompt tokens
        remaining -= take
    active += remaining   # outstanding tokens this policy did not route: counted whole

Exact when the pod serves prefills in arrival order and only this policy routes to it;
otherwise an estimate (another replica's requests count whole, as they would for a router
that never saw their cache hits).  The predicted uncached tokens are the ones the policy
recorded with :meth:`scored` at pick time for the pod it then routed to; a request routed
to a pod it was not scored for (a retry) counts its whole prompt.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

from scoring.policies.base import PodView, RouteRequest

_MAX_SCORED = 65_536

Key = tuple[str, int]


def request_key(request: RouteRequest) -> Key:
    """``(request_id, id(request))``: a client may reuse an id, and the router hands the
    same object to pick / on_routed / on_complete."""
    return (request.request_id, id(request))


class ActivePrefill:
    """The bookkeeping above, for one policy instance."""

    def __init__(self) -> None:
        # key -> {pod: predicted uncached tokens}, from pick until routed
        self._scored: OrderedDict[Key, dict[str, int]] = OrderedDict()
        # key -> pod, while live
        self._pod_of: dict[Key, str] = {}
        # pod -> key -> (prompt tokens, predicted uncached tokens), in routing order
        self._by_pod: dict[str, dict[Key, tuple[int, int]]] = {}

    def scored(self, request: RouteRequest, uncached: Mapping[str, int]) -> None:
        """Remember the uncached tokens predicted per pod for ``request`` (until routed)."""
        scored = self._scored
        scored[request_key(request)] = dict(uncached)
        if len(scored) > _MAX_SCORED:  # picks never routed must not pile up
            scored.popitem(last=False)

    def routed(self, request: RouteRequest, pod: str) -> None:
        key = request_key(request)
        predicted = self._scored.pop(key, {})
        prompt = max(0, request.prompt_tokens)
        uncached = predicted.get(pod, prompt)
        self.complete(request)  # routed again (a retry): forget the first attempt
        self._pod_of[key] = pod
        self._by_pod.setdefault(pod, {})[key] = (prompt, min(prompt, max(0, uncached)))

    def complete(self, request: RouteRequest) -> None:
        key = request_key(request)
        pod = self._pod_of.pop(key, None)
        if pod is not None:
            live = self._by_pod.get(pod)
            if live is not None:
                live.pop(key, None)

    def pod_removed(self, pod: str) -> None:
        for key in self._by_pod.pop(pod, {}):
            self._pod_of.pop(key, None)

    def tokens(self, view: PodView) -> float:
        """Uncached prompt tokens of the requests on ``view``'s pod still in prefill."""
        remaining = float(max(0, view.outstanding_prefill_tokens))
        if remaining <= 0:
            return 0.0
        active = 0.0
        live = self._by_pod.get(view.pod)
        if live:
            for prompt, uncached in reversed(live.values()):
                if prompt <= 0:
                    continue
                if prompt >= remaining:
                    active += uncached * remaining / prompt
                    return active
                active += uncached
                remaining -= prompt
        return active + remaining

    def live_requests(self, pod: str) -> int:
        """Requests routed to ``pod`` and not complete (for tests and explanation)."""
        return len(self._by_pod.get(pod, ()))
