"""The load view: what the router knows about how busy each pod is.

Two sources, merged per pod into the :class:`~scoring.policies.PodView` fields:

* **Router-tracked** (exact, immediate): ``inflight`` — requests routed to the pod and not
  finished; ``outstanding_prefill_tokens`` — prompt tokens of those requests whose prefill
  has not finished, i.e. until the first streamed token (or the whole response when not
  streaming) came back.  Kept in memory (:class:`MemoryLoadStore`) or, with ``redis_url``,
  in Redis so that every replica sees the same load (:class:`RedisLoadStore`).
* **Scraped** from each pod's ``/metrics`` (:mod:`router.fleet.scrape`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from router.fleet.first_tokens import FirstTokenLedger, Unseen

log = logging.getLogger(__name__)


class LoadStore(Protocol):
    """Per-pod counters of in-flight requests and outstanding prefill tokens."""

    async def begin(self, pod: str, prefill_tokens: int) -> None:
        """A request with ``prefill_tokens`` uncached-or-not prompt tokens went to ``pod``."""
        ...

    async def prefill_done(self, pod: str, prefill_tokens: int) -> None:
        """Its first token (or whole response) came back: prefill no longer outstanding."""
        ...

    async def end(self, pod: str) -> None:
        """The request finished (success, error or cancel)."""
        ...

    async def snapshot(self, pods: Iterable[str]) -> dict[str, tuple[int, int]]:
        """pod -> (inflight, outstanding prefill tokens)."""
        ...

    async def clear_pod(self, pod: str) -> None: ...

    async def close(self) -> None: ...


class MemoryLoadStore:
    """The load store of a single replica."""

    def __init__(self) -> None:
        self._inflight: dict[str, int] = {}
        self._prefill: dict[str, int] = {}

    # synchronous twins: the proxy calls these directly (no coroutine per update)
    def begin_now(self, pod: str, prefill_tokens: int) -> None:
        self._inflight[pod] = self._inflight.get(pod, 0) + 1
        self._prefill[pod] = self._prefill.get(pod, 0) + prefill_tokens

    def prefill_done_now(self, pod: str, prefill_tokens: int) -> None:
        self._prefill[pod] = max(0, self._prefill.get(pod, 0) - prefill_tokens)

    def end_now(self, pod: str) -> None:
        self._inflight[pod] = max(0, self._inflight.get(pod, 0) - 1)

    async def begin(self, pod: str, prefill_tokens: int) -> None:
        self.begin_now(pod, prefill_tokens)

    async def prefill_done(self, pod: str, prefill_tokens: int) -> None:
        self.prefill_done_now(pod, prefill_tokens)

    async def end(self, pod: str) -> None:
        self.end_now(pod)

    def counts(self) -> tuple[Callable[[str, int], int], Callable[[str, int], int]]:
        """Readers of (in-flight, outstanding prefill) by pod, with a default: what
        :meth:`snapshot_now` reads, for a caller that wants no snapshot."""
        return self._inflight.get, self._prefill.get

    def snapshot_now(self, pods: Iterable[str]) -> dict[str, tuple[int, int]]:
        inflight, prefill = self._inflight, self._prefill
        return {p: (inflight.get(p, 0), prefill.get(p, 0)) for p in pods}

    async def snapshot(self, pods: Iterable[str]) -> dict[str, tuple[int, int]]:
        return self.snapshot_now(pods)

    async def clear_pod(self, pod: str) -> None:
        self._inflight.pop(pod, None)
        self._prefill.pop(pod, None)

    async def close(self) -> None:
        return None


class PendingLoad:
    """Requests this replica routed whose ``begin`` has not reached the load store yet.

    With a shared (Redis) store, ``begin`` is a network round trip; requests decided
    meanwhile would not see each other and pile onto the same pod.  The proxy adds a
    request here synchronously with the decision and removes it once ``begin`` landed;
    the request path adds these counts to the store's snapshot.
    """

    __slots__ = ("_n", "_tokens")

    def __init__(self) -> None:
        self._n: dict[str, int] = {}
        self._tokens: dict[str, int] = {}

    def add(self, pod: str, tokens: int) -> None:
        self._n[pod] = self._n.get(pod, 0) + 1
        self._tokens[pod] = self._tokens.get(pod, 0) + tokens

    def remove(self, pod: str, tokens: int) -> None:
        n = self._n.get(pod, 0) - 1
        if n <= 0:
            self._n.pop(pod, None)
            self._tokens.pop(pod, None)
        else:
            self._n[pod] = n
            self._tokens[pod] = max(0, self._tokens.get(pod, 0) - tokens)

    def get(self, pod: str) -> tuple[int, int]:
        return self._n.get(pod, 0), self._tokens.get(pod, 0)


class RequestLoad:
    """The load one request puts on its pod; guarantees each counter is undone once."""

    __slots__ = (
        "_ended",
        "_prefilled",
        "ledger",
        "local",
        "pod",
        "prefill_tokens",
        "store",
        "ticket",
    )

    def __init__(
        self,
        store: LoadStore,
        pod: str,
        prefill_tokens: int,
        ledger: FirstTokenLedger | None = None,
    ) -> None:
        self.store = store
        #: told of the request's end; ``ticket``: set when its first token will not be
        #: seen (router/fleet/first_tokens.py)
        self.ledger = ledger
        self.ticket: Unseen | None = None
        #: the store when it is this process's memory: then the ``*_now`` methods apply
        #: the counts synchronously (no await, so no pending overlay is needed either)
        self.local = store if isinstance(store, MemoryLoadStore) else None
        self.pod = pod
        self.prefill_tokens = prefill_tokens
        self._prefilled = False
        self._ended = False

    def begin_now(self) -> None:
        assert self.local is not None
        self.local.begin_now(self.pod, self.prefill_tokens)
        if self.ledger is not None:
            self.ledger.started(self.pod)

    def first_token_now(self) -> None:
        assert self.local is not None
        if not self._prefilled:
            self._prefilled = True
            self.local.prefill_done_now(self.pod, self.prefill_tokens)

    def end_now(self) -> None:
        assert self.local is not None
        if self._ended:
            return
        self.first_token_now()
        self._ended = True
        self.local.end_now(self.pod)
        if self.ledger is not None:
            self.ledger.ended(self.pod, self.ticket)

    async def begin(self) -> None:
        if self.ledger is not None:
            self.ledger.started(self.pod)
        await self.store.begin(self.pod, self.prefill_tokens)

    async def first_token(self) -> None:
        if not self._prefilled:
            self._prefilled = True
            await self.store.prefill_done(self.pod, self.prefill_tokens)

    async def end(self) -> None:
        if self._ended:
            return
        self._ended = True
        if self.ledger is not None:
            self.ledger.ended(self.pod, self.ticket)
        await self.first_token()
        await self.store.end(self.pod)
