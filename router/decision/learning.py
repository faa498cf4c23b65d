"""Learning a pod's cache from the requests the router sends it, where its KV events
cannot tell (issues #10 and #15): one mechanism for pods that publish no events and for
pods whose index entries were lost.

:class:`RouteLearner` owns a :class:`~scoring.index.speculative.SpeculativeIndex` and
decides, per pod, when routed requests are written into it, how the entries merge into
the views, and when they are confirmed or dropped.

**Which pods learn** (their *reason*, ``kvroute_speculative_learning``):

* ``events_off`` -- no KV events reach the index at all (in-memory index with
  ``events.enabled: false``): every pod, always.  Dynamo's ``--no-router-kv-events``.
* ``never_published`` -- the pod has published no event since it was registered (an
  engine started without ``--kv-events-config``, or a publisher that cannot reach us),
  judged from the sink (events applied here) or, for a replica reading a shared index,
  from the index holding no entry for the pod.  Ends with its first event / entry.
* ``cleared`` -- the index forgot the pod without a complete replay (the subscriber's
  resync: a gap the replay buffer no longer covers, a queue overflow, an undecodable
  batch, a failed apply, skipped events, a reconnection; or an engine restart).  The
  pod's cache did not change, only our view of it: the GPU blocks the index held are
  *carried over* as speculative entries (``router.events.IndexSink.clear_pod``), so its
  hot prefixes never go dark.  An engine restart, whose cache really is empty, shows as
  the pod's ``vllm:prefix_cache_hits_total`` going back: all its entries are dropped.
  For a replica reading a shared index (no sink here, nothing to carry): the pod's entry
  count fell to half or less between two reads of the index-gauge loop (normal eviction
  is paired with a store and keeps the count; a drop is a reset, or Redis data loss such
  as a FLUSHALL), and the pod is re-learned from the requests sent to it.
* ``incomplete`` -- the applier holds orphans for the pod (a ``BlockStored`` whose parent
  it never saw: the router joined late and the replay buffer did not reach back).

``cleared`` and ``incomplete`` end when the index again counts at least the pod's whole
cache (``num_gpu_blocks``, scraped): then no block it holds can be missing from the
index.  A hot prefix that stays cached keeps the count below that, so a pod that still
serves an unannounced prefix keeps learning -- which is the point.  An
``AllBlocksCleared`` also ends it (the index, empty, is exact again).

**Writes**: when a request is sent to a learning pod (the proxy's attempt, not
``/v1/route``), the blocks of its chain the index does not show on that pod are held
speculatively for ``speculative.ttl_s``, re-armed by every later request with that
chain.  With ``speculative.routed_ttl_s`` > 0 every other pod's routed chains are held
that long too (llm-d's ``speculativeTTL``, 2 s: the gap between routing and the
``BlockStored`` of a miss).  A request whose prompt was tokenized approximately writes
nothing (its keys may not be the engine's).

**Views**: a pod's GPU hits are its index hits continued by its speculative entries
(:meth:`SpeculativeIndex.lookup`); ``PodView.speculative`` says how many of them are
speculative, and ``/v1/route`` shows it.

**Confirmed or dropped**:

* a ``BlockStored`` of a key on the pod confirms it (the index has it; the entry goes);
  so does a request sent to the pod whose index hits cover it (for a replica reading a
  shared index, which sees no events, the only confirmation);
* a ``BlockRemoved`` drops it (also of a carried block, by its engine hash);
  ``AllBlocksCleared``, an engine restart or the pod leaving drops them all;
* the pod's own ``vllm:prefix_cache_hits_total`` (tokens; vLLM counts a request's hit
  when it is first scheduled).  A *probe* opens when a request is sent to a pod with
  speculative credit: baseline = the counter's last scraped value.  Every request sent
  to the pod until the next scrape joins it, with its expected hit tokens from the
  index (``I``) and from speculative entries (``S``), capped as vLLM caps a hit
  (``floor((prompt - 1) / block_size)`` blocks).  The probe is judged at the first
  later scrape that shows no waiting request (every request it holds was scheduled, so
  its hit is counted): if the counter moved by less than ``sum(I) + sum(S) / 2`` (the
  midpoint between "the speculative blocks were cached" and "they were not"), its
  requests' speculative blocks are dropped.  Hits of other requests (other replicas,
  requests sent during judging) only add to the movement: the test errs towards
  keeping.  A probe not judged within :data:`PROBE_PATIENCE` scrapes, or whose counter
  went back (engine restart), is abandoned.

Several replicas each learn from the requests they route; the hit counter they read is
the pod's, so their probes are lenient, never wrong the other way.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from scoring.index.speculative import SpeculativeIndex

if TYPE_CHECKING:
    from router.config_sections import SpeculativeSettings
    from router.decision.request import Routed
    from router.fleet.scrape import Scraped

#: scrapes a closed probe waits for a sample with no waiting request before it is
#: abandoned (no verdict: the entries stay until their TTL)
PROBE_PATIENCE = 10

#: the reasons that end when the index counts the pod's whole cache again
_RELEARNING = frozenset({"cleared", "incomplete"})


@dataclass(slots=True)
class _Probe:
    baseline: float
    closed: bool = False
    scrapes: int = 0
    index_tokens: int = 0
    spec_tokens: int = 0
    #: (chain, first speculative block, end) of each speculatively credited request
    chains: list[tuple[Sequence[int], int, int]] = field(default_factory=list)


class RouteLearner:
    """Speculative entries for the pods that need them (see the module doc)."""

    def __init__(
        self,
        settings: SpeculativeSettings,
        *,
        events_off: bool,
        tier: str = "GPU",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.enabled = settings.enabled
        self.events_off = events_off
        self.tier = tier
        self.index = SpeculativeIndex(settings.max_entries, clock=clock)
        self._ttl = settings.ttl_s
        self._routed_ttl = settings.routed_ttl_s
        #: pod -> why it learns (events_off and never_published are derived, not kept)
        self.learning: dict[str, str] = {}
        self._published: set[str] = set()
        self._probes: dict[str, _Probe] = {}
        #: pod -> its last scraped vllm:prefix_cache_hits_total
        self._counter: dict[str, float] = {}
        self._entries_prev: dict[str, int] = {}
        #: requests sent to a pod with speculative credit, per pod
        self.hits: Counter[str] = Counter()
        #: entries dropped, by why
        self.dropped: Counter[str] = Counter()
        #: probes judged, by verdict ("kept", "dropped", "abandoned")
        self.probes: Counter[str] = Counter()

    # -- state ---------------------------------------------------------------------

    def reason(self, pod: str) -> str | None:
        """Why ``pod`` learns from routed requests (None: it does not)."""
        if self.events_off:
            return "events_off"
        why = self.learning.get(pod)
        if why is not None:
            return why
        return None if pod in self._published else "never_published"

    # -- the request path ------------------------------------------------------------

    def extend(
        self, keys: Sequence[int], names: Sequence[str], hits: Mapping[str, Mapping[str, int]]
    ) -> dict[str, int] | None:
        """Per pod, its leading blocks by the index continued by speculative entries
        (only pods the entries extend; None when there are none at all)."""
        index = self.index
        if not len(index) or not keys:
            return None
        tier = self.tier
        starts = {name: h.get(tier, 0) for name, h in hits.items()} if hits else None
        return index.lookup(keys, names, starts) or None

    def on_sent(self, routed: Routed, pod: str) -> None:
        """A request is being sent to ``pod``: write its chain if the pod learns, and
        count / probe its speculative credit."""
        if not self.enabled:
            return
        route = routed.route
        keys = route.block_keys
        if not keys or routed.approximate:
            return
        view = routed.views.get(pod)
        spec = view.speculative if view is not None else 0
        gpu = view.hits.get(self.tier, 0) if view is not None else 0
        known = gpu - spec
        if spec:
            self.hits[pod] += 1
        if known and self.index.has_entries(pod):
            # what the index shows now needs no entry (for a replica reading a shared
            # index, whose events it never sees, this is the confirmation)
            self.index.confirm(pod, keys[:known])
        if self.settings.verify:
            self._probe(pod, keys, known, spec, route.prompt_tokens, route.block_size)
        ttl = self._ttl if self.reason(pod) is not None else self._routed_ttl
        if ttl > 0:
            self.index.add(pod, keys, ttl, start=known)

    def _probe(
        self, pod: str, keys: Sequence[int], known: int, spec: int, prompt: int, bs: int
    ) -> None:
        p = self._probes.get(pod)
        if p is None:
            if not spec:
                return
            base = self._counter.get(pod)
            if base is None:
                return  # the pod exposes no hit counter: nothing to test against
            p = self._probes[pod] = _Probe(base)
        elif p.closed:
            return
        cap = max(prompt - 1, 0) // bs * bs
        credit = min((known + spec) * bs, cap)
        index_tokens = min(known * bs, credit)
        p.index_tokens += index_tokens
        if spec:
            p.spec_tokens += credit - index_tokens
            p.chains.append((keys, known, known + spec))

    # -- the pods' metrics -----------------------------------------------------------

    def on_scraped(self, pod: str, scraped: Scraped) -> None:
        """A fresh scrape of ``pod``: move or judge its probe."""
        hits = scraped.prefix_hits
        if hits is None:
            return
        prev = self._counter.get(pod)
        self._counter[pod] = hits
        if prev is not None and hits < prev:
            # the counter went back: the engine restarted and its cache is empty
            if self._probes.pop(pod, None) is not None:
                self.probes["abandoned"] += 1
            self.dropped["restart"] += self.index.drop_pod(pod)
            return
        p = self._probes.get(pod)
        if p is None:
            return
        if not p.closed:
            p.closed = True
            return
        p.scrapes += 1
        if scraped.waiting:
            if p.scrapes >= PROBE_PATIENCE:
                del self._probes[pod]
                self.probes["abandoned"] += 1
            return
        del self._probes[pod]
        moved = hits - p.baseline
        if 2 * moved >= 2 * p.index_tokens + p.spec_tokens:
            self.probes["kept"] += 1
            return
        self.probes["dropped"] += 1
        n = 0
        for chain, start, end in p.chains:
            n += self.index.drop(pod, chain[start:end])
        self.dropped["no_hits"] += n

    # -- the events side -------------------------------------------------------------

    def stored(self, pod: str, keys: Sequence[int]) -> None:
        """The index stored ``keys`` on ``pod`` (a ``BlockStored``)."""
        self._published.add(pod)
        if keys:
            self.index.confirm(pod, keys)

    def removed(self, pod: str, keys: Sequence[int]) -> None:
        """The index removed ``keys`` of ``pod`` (a ``BlockRemoved``)."""
        self._published.add(pod)
        if keys:
            self.dropped["removed"] += self.index.drop(pod, keys)

    def all_cleared(self, pod: str) -> None:
        """``AllBlocksCleared``: the pod's cache is empty, and the index says so."""
        self._published.add(pod)
        self.learning.pop(pod, None)
        self._probes.pop(pod, None)
        self.dropped["all_cleared"] += self.index.drop_pod(pod)

    def published(self, pod: str) -> None:
        """Some event of ``pod`` was applied."""
        self._published.add(pod)

    def cleared(self, pod: str, carried: Sequence[int] = ()) -> None:
        """The index forgot ``pod`` without a complete replay: learn it again, starting
        from ``carried`` (the GPU blocks the index held for it, now speculative)."""
        self.learning[pod] = "cleared"
        if carried and self.enabled:
            self.index.add(pod, carried, self._ttl)

    def incomplete(self, pod: str) -> None:
        """The index lacks some ancestors of what ``pod`` announces (orphans)."""
        self.learning.setdefault(pod, "incomplete")

    def gone(self, pod: str) -> None:
        """``pod`` left the fleet."""
        self.learning.pop(pod, None)
        self._published.discard(pod)
        self._probes.pop(pod, None)
        self._counter.pop(pod, None)
        self._entries_prev.pop(pod, None)
        self.hits.pop(pod, None)
        self.dropped["pod_gone"] += self.index.drop_pod(pod)

    def index_entries(
        self,
        entries: Mapping[str, int],
        pods: Iterable[str],
        capacity_of: Callable[[str], int | None],
        *,
        shared: bool,
    ) -> None:
        """The index-gauge loop's periodic count of entries per pod.  ``shared``: this
        process does not apply the events (a replica reading Redis), so a pod's count
        is also what says it publishes, and a count falling to half or less says its
        entries were lost."""
        for pod in pods:
            n = entries.get(pod, 0)
            prev = self._entries_prev.get(pod)
            self._entries_prev[pod] = n
            if shared:
                if n > 0:
                    self._published.add(pod)
                if prev and 2 * n <= prev:
                    self.cleared(pod)
            if self.learning.get(pod) in _RELEARNING:
                cap = capacity_of(pod)
                if cap and n >= cap:
                    del self.learning[pod]

    # -- metrics ---------------------------------------------------------------------

    def collect(self, pods: Iterable[str]) -> Iterable[Metric]:
        """``kvroute_speculative_*`` families, at scrape time."""
        st = self.index.stats
        entries = GaugeMetricFamily(
            "kvroute_speculative_entries",
            "Live speculative (routing-learned) block entries, by pod",
            labels=["pod"],
        )
        for pod, n in sorted(self.index.pod_entries().items()):
            entries.add_metric([pod], n)
        yield entries
        learning = GaugeMetricFamily(
            "kvroute_speculative_learning",
            "1 while a pod is learned from routed requests, by pod and reason",
            labels=["pod", "reason"],
        )
        for pod in sorted(set(pods)):
            why = self.reason(pod)
            if why is not None:
                learning.add_metric([pod, why], 1.0)
        yield learning
        hits = CounterMetricFamily(
            "kvroute_speculative_hits",
            "Requests sent to a pod credited with speculative blocks, by pod",
            labels=["pod"],
        )
        for pod, n in sorted(self.hits.items()):
            hits.add_metric([pod], n)
        yield hits
        for name, doc, value in (
            ("written", "Speculative entries written", st.written),
            ("confirmed", "Speculative entries confirmed by a BlockStored", st.confirmed),
            ("expired", "Speculative entries expired (TTL)", st.expired),
            ("evicted", "Speculative entries evicted by speculative.max_entries", st.evicted),
        ):
            yield CounterMetricFamily(f"kvroute_speculative_{name}", doc, value=value)
        dropped = CounterMetricFamily(
            "kvroute_speculative_dropped",
            "Speculative entries found wrong, by reason",
            labels=["reason"],
        )
        for why in ("removed", "all_cleared", "no_hits", "restart", "pod_gone"):
            dropped.add_metric([why], self.dropped[why])
        yield dropped
        probes = CounterMetricFamily(
            "kvroute_speculative_probes",
            "Hit-counter checks of speculative credit, by verdict",
            labels=["verdict"],
        )
        for verdict in ("kept", "dropped", "abandoned"):
            probes.add_metric([verdict], self.probes[verdict])
        yield probes
