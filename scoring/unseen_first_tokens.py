"""Requests whose first token the router never sees, released from the queue by the
pod's own count of first tokens.

vLLM sends a JSON answer (``"stream": false``) whole, after its last token.  A router
that forwards it as it came (``--no-proxy.stream-json-answers``, or the Endpoint Picker,
where the gateway carries the answer) never sees its first token.  Without one, the
router's load holds the prompt as outstanding prefill until the answer ends: through
the whole decode.  The replay measured what that costs ``cost``: a TTFT p90 1.2-1.55x
worse across the quick matrix (docs/history/quality_matrix.md, "Session 19").

The pod knows.  vLLM observes ``vllm:time_to_first_token_seconds`` when a request's
first token comes out of an engine step (``IterationStats``), not when the request
ends, so the histogram's ``_count`` is the pod's count of first tokens, and the
router scrapes it every ``scrape.interval_s``.  Between two scrapes::

    unseen = (count - count at the first scrape) - first tokens the router saw there
             - requests already released

first tokens came out that the router did not see: those of its JSON requests, which a
vLLM engine serves FCFS.  So the ``unseen`` oldest pending ones (at most all of them)
are past their prefill, and are released: the load's prefill part ends and the policy
hears :meth:`~scoring.policies.base.Policy.on_prefill_done` (no time: a scrape only
bounds it, so nothing learns from it).  A request that ends first is simply dropped.

What it cannot tell:

* **Other routers' requests.** A pod that also serves another router's traffic (a
  second replica, ``--workers N``) counts their first tokens too.  The release is
  scaled by this router's share of the requests the pod finished
  (``vllm:request_success_total``, summed over its reasons) since the first scrape,
  counting as ours every request of ours that ended there or is still open (one that
  finished on the pod may not have ended here yet): alone in front of the pod, 1.
* **A first token in flight** at a scrape (counted by the engine, not yet read by the
  router) can release one JSON request one scrape early; the counts catch up.
* **Requests sent before a pod's first scrape** (or before an engine restart, when its
  count goes down and the accounting starts again from the new count) may have had
  their first token before the count's baseline: they wait for their end, as without
  this.  A router scrapes a pod as soon as it is registered, so that is rare.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)


class _Pod(Generic[T]):
    __slots__ = (
        "base",
        "done",
        "done_base",
        "last",
        "open",
        "pending",
        "released",
        "seen",
        "unknown",
    )

    def __init__(self) -> None:
        #: tickets of the requests whose first token the router will not see, oldest first
        self.pending: dict[T, None] = {}
        #: those sent before the count's baseline: their first token may be in it already,
        #: so no later count can tell theirs; they wait for their end
        self.unknown: dict[T, None] = {}
        self.base: float | None = None  # the pod's count at the first scrape
        self.last = 0.0  # its count at the last scrape
        self.done_base: float | None = None  # the pod's finished requests then
        self.seen = 0  # first tokens the router saw on the pod since the first scrape
        self.released = 0  # pending requests released since then
        self.done = 0  # requests of this router that ended on the pod since then
        self.open = 0  # requests of this router on the pod now (sent, not ended)


class UnseenFirstTokens(Generic[T]):
    """Per pod: the requests whose first token the router will not see (module docstring)."""

    __slots__ = ("_pods",)

    def __init__(self) -> None:
        self._pods: dict[str, _Pod[T]] = {}

    def _pod(self, pod: str) -> _Pod[T]:
        p = self._pods.get(pod)
        if p is None:
            p = self._pods[pod] = _Pod()
        return p

    def started(self, pod: str) -> None:
        """A request of this router was sent to ``pod``."""
        self._pod(pod).open += 1

    def expect(self, pod: str, ticket: T) -> None:
        """``ticket``'s request was sent to ``pod`` and its first token will not be seen."""
        self._pod(pod).pending[ticket] = None

    def seen(self, pod: str) -> None:
        """The router saw a first token come back from ``pod``."""
        p = self._pods.get(pod)
        if p is None:
            p = self._pod(pod)
        if p.base is not None:
            p.seen += 1

    def ended(self, pod: str, ticket: T | None = None) -> bool:
        """A request of this router ended on ``pod`` (``ticket``: one that was expected);
        True when it was still pending (its prefill part not yet released)."""
        p = self._pods.get(pod)
        if p is None:
            return False
        if p.open > 0:
            p.open -= 1
        if p.base is not None:
            p.done += 1
        if ticket is None:
            return False
        return p.pending.pop(ticket, 0) is None or p.unknown.pop(ticket, 0) is None

    def seen_count(self, pod: str) -> int:
        """First tokens the router saw on ``pod`` since its count's baseline."""
        p = self._pods.get(pod)
        return p.seen if p is not None else 0

    def pending(self, pod: str) -> int:
        p = self._pods.get(pod)
        return len(p.pending) if p is not None else 0

    def scraped(self, pod: str, first_tokens: float | None, finished: float | None) -> list[T]:
        """The pod's scraped count of first tokens (``None``: it exports none) and of
        finished requests (``None``: unknown, counted as this router's alone); returns
        the pending tickets now past their first token, oldest first."""
        if first_tokens is None or not first_tokens >= 0.0:  # (NaN too)
            return []
        p = self._pod(pod)
        if p.base is None or first_tokens < p.last:  # the first scrape, or a restart
            p.base, p.last = first_tokens, first_tokens
            p.done_base = finished
            p.seen = p.released = p.done = 0
            p.unknown.update(p.pending)
            p.pending.clear()
            return []
        p.last = first_tokens
        produced = first_tokens - p.base
        if finished is not None and p.done_base is not None and finished >= p.done_base:
            total = finished - p.done_base
            ours = p.done + p.open  # ours that may have finished there: at most these
            if total > ours:  # others' requests finished there too: only our share
                produced *= ours / total
        n = min(int(produced) - p.seen - p.released, len(p.pending))
        if n <= 0:
            return []
        out: list[T] = []
        pending = p.pending
        for ticket in pending:
            out.append(ticket)
            if len(out) == n:
                break
        for ticket in out:
            del pending[ticket]
        p.released += n
        return out

    def forget(self, pod: str) -> None:
        """``pod`` left the fleet."""
        self._pods.pop(pod, None)
