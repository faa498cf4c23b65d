"""One :class:`~scoring.policies.base.PodView` per candidate pod: the index's hits for
the request's block keys (continued by the speculative entries of
:class:`~router.decision.learning.RouteLearner`: ``PodView.speculative``), the
router-tracked load (plus the pending overlay of a shared store), fresh scraped metrics
and how many blocks each pod's cache holds.

An in-memory index and load store are read without awaiting (no coroutine per request
for what is a dict lookup): :attr:`ViewBuilder.immediate` says when.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from router.decision.learning import RouteLearner
from router.fleet.load import LoadStore, MemoryLoadStore, PendingLoad
from router.fleet.scrape import MetricsScraper
from scoring.index.base import BlockIndex
from scoring.index.breaker import SharedStateUnavailable
from scoring.index.memory import InMemoryIndex
from scoring.policies.base import PodView

_monotonic = time.monotonic
_NO_LOAD = (0, 0)
#: an in-memory index's per-pod entry counts are re-read at most this often
RESIDENT_STALE_S = 0.05


class ViewBuilder:
    """Builds the candidates' views for the policy."""

    def __init__(
        self,
        index: BlockIndex,
        load: LoadStore,
        scraper: MetricsScraper | None,
        pending: PendingLoad,
        learner: RouteLearner | None = None,
        fallback: Callable[[Sequence[int], list[str]], Mapping[str, int]] | None = None,
    ) -> None:
        self.index = index
        #: per pod, the leading blocks of the keys this replica routed there: the hits
        #: while the shared index cannot be read (the policy's ``routed_prefixes``)
        self.fallback = fallback
        #: speculative entries merged into the hits (None or disabled: none)
        self.learner = learner if learner is not None and learner.enabled else None
        self._tier = index.tiers[0]
        self.load = load
        self.scraper = scraper
        self.pending = pending
        self._local_load = load if isinstance(load, MemoryLoadStore) else None
        #: the in-memory index's lookup, when views can be built without awaiting
        self.lookup_now = (
            index.lookup_sync
            if isinstance(index, InMemoryIndex) and self._local_load is not None
            else None
        )
        #: pod -> index entries, for the policy's ``PodView.resident_blocks``; kept fresh
        #: here for an in-memory index, set by the core's index-gauge loop for Redis
        self.resident: Mapping[str, int] = {}
        self._entries_now = index.pod_entries_sync if isinstance(index, InMemoryIndex) else None
        self._resident_at = float("-inf")

    async def views(self, keys: Sequence[int], names: list[str]) -> dict[str, PodView]:
        """The views from a shared (Redis) index and load store.  While Redis is
        unavailable (:class:`SharedStateUnavailable`: its deadline passed, or the
        breaker is open) the request is routed on what this replica has: the prefixes
        it routed to each pod (``fallback``) for hits, and its own load counts (which
        already hold its in-flight requests, so no pending overlay)."""
        try:
            hits = await self.index.lookup(keys, names) if keys else {}
        except SharedStateUnavailable:
            hits = self._routed_hits(keys, names)
        overlay = True
        try:
            load = await self.load.snapshot(names)
        except SharedStateUnavailable:
            local = getattr(self.load, "local_snapshot", None)
            load = local(names) if local is not None else {}
            overlay = False
        return self._merge_views(hits, load, names, keys, overlay)

    def _routed_hits(self, keys: Sequence[int], names: list[str]) -> dict[str, dict[str, int]]:
        if self.fallback is None or not keys:
            return {}
        tier = self._tier
        return {pod: {tier: n} for pod, n in self.fallback(keys, names).items()}

    def views_now(
        self,
        hits: Mapping[str, Mapping[str, int]],
        names: list[str],
        keys: Sequence[int] = (),
    ) -> dict[str, PodView]:
        """:meth:`views` for an in-memory index and load store: no awaits (and no
        snapshot: the store's counts are read directly)."""
        local = self._local_load
        assert local is not None
        inflight_of, prefill_of = local.counts()
        return self._build_views(hits, names, inflight_of, prefill_of, None, keys)

    def _merge_views(
        self,
        hits: Mapping[str, Mapping[str, int]],
        load: Mapping[str, tuple[int, int]],
        names: list[str],
        keys: Sequence[int],
        overlay: bool = True,
    ) -> dict[str, PodView]:
        # the pending overlay (read after the awaits) only ever holds anything with a
        # shared store: the proxy updates a local one synchronously
        pending = self.pending.get if overlay and self._local_load is None else None
        return self._build_views(
            hits,
            names,
            lambda pod, _: load.get(pod, _NO_LOAD)[0],
            lambda pod, _: load.get(pod, _NO_LOAD)[1],
            pending,
            keys,
        )

    def _build_views(
        self,
        hits: Mapping[str, Mapping[str, int]],
        names: list[str],
        inflight_of: Callable[[str, int], int],
        prefill_of: Callable[[str, int], int],
        pending: Callable[[str], tuple[int, int]] | None,
        keys: Sequence[int] = (),
    ) -> dict[str, PodView]:
        """One view per candidate: index hits (continued by speculative entries),
        router-tracked load (plus the pending overlay), fresh scraped metrics, and how
        many blocks its cache holds."""
        learner = self.learner
        spec = learner.extend(keys, names, hits) if learner is not None and keys else None
        tier = self._tier
        scraper = self.scraper
        scraped_of = scraper.fresh() if scraper is not None else None
        resident_of = self._resident_blocks().get
        views: dict[str, PodView] = {}
        for name in names:
            inflight = inflight_of(name, 0)
            prefill = prefill_of(name, 0)
            if pending is not None:
                p_n, p_tokens = pending(name)
                inflight += p_n
                prefill += p_tokens
            held = hits.get(name)
            own = dict(held) if held else {}
            extra = 0
            if spec is not None:
                n = spec.get(name)
                if n is not None:
                    # speculative blocks are GPU blocks: servable from every tier's view
                    extra = n - own.get(tier, 0)
                    for t, v in own.items():
                        if v < n:
                            own[t] = n
                    own[tier] = n
            scraped = scraped_of(name) if scraped_of is not None else None
            views[name] = PodView(
                name,
                own,
                inflight,
                prefill,
                None if scraped is None else scraped.waiting,
                None if scraped is None else scraped.running,
                None if scraped is None else scraped.kv_usage,
                resident_of(name, 0),
                None if scraped is None else scraped.capacity_blocks,
                extra,
            )
        return views

    def _resident_blocks(self) -> Mapping[str, int]:
        """Index entries per pod (what each pod's cache holds): from an in-memory index
        at most :data:`RESIDENT_STALE_S` old; for Redis the app's periodic count
        (:attr:`resident`)."""
        entries = self._entries_now
        if entries is not None:
            now = _monotonic()
            if now - self._resident_at > RESIDENT_STALE_S:
                self._resident_at = now
                self.resident = entries()
        return self.resident
