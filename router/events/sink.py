"""The sink the subscriber feeds: ``scoring.events.IndexSink`` plus router extensions.

``scoring.events.IndexSink`` decodes vLLM batches and applies them to a
:class:`~scoring.index.base.BlockIndex` through a ``KVEventApplier`` (engine hash ->
our key per pod, counted stores, orphans).  The base class already has
``remove_pod`` (a pod left the fleet: forget it entirely in the applier too); this
subclass adds what else the subscriber uses when present (see
:class:`~router.events.subscriber.EventSink`):

* :meth:`lost_events` — the applier had to skip some of the pod's events, so the
  subscriber resyncs it.
* :meth:`apply_checked` — ``apply``, refusing a batch after which the pod would hold
  more GPU blocks than its cache has (:mod:`router.events.guard`).
* :meth:`extra_stats` / :meth:`gauges` — engine-hash mode counters, exported next to
  the applier's.

With a :class:`~router.decision.learning.RouteLearner` (:attr:`IndexSink.learner`), it
tells the speculative entries what the events say: each batch's adds confirm, its
removals drop, an ``AllBlocksCleared`` drops all of the pod's; orphans mark the pod
incomplete; its leaving drops everything.  A resync (:meth:`clear_pod`: the subscriber
lost events and has no complete replay) *carries* the pod's GPU entries over into
speculative ones before the index forgets them -- the pod's cache did not change, only
our view of it, so its hot prefixes stay visible -- and the pod learns from routed
requests until its index is whole again.  The carried blocks' engine hashes are kept, so
a later ``BlockRemoved`` of one of them (which the applier, having forgotten it, ignores)
still drops its entry.  These are calls the subscriber already makes, so nothing in its
loop changes.

And, in engine-hash mode (``events.engine_hash_algo``), :meth:`learn_later`: the router
hands it each routed request's chain; one background task learns the chains
(``KVEventApplier.learn``, ~2-3 us per block: off the request's path) and applies the
index writes of the orphans they link.  The queue is bounded: when full, the request is
dropped and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from router.events.guard import PodFacts, check_held
from scoring.events import IndexSink as _ScoringIndexSink
from scoring.events.apply import FAST_TIER, Held, IndexOps
from scoring.events.decode import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    EventBatch,
)
from scoring.events.engine_hash import DEFAULT_SEED, EngineHasher

if TYPE_CHECKING:
    from router.config import Settings
    from router.decision.learning import RouteLearner
    from router.events.settings import EventsSettings

log = logging.getLogger(__name__)

_Chain = tuple[str, Sequence[int], int, Sequence[int], str | None, str | None]


def build_engine_hasher(events: EventsSettings) -> EngineHasher | None:
    """The :class:`EngineHasher` configured by ``events.engine_hash_*`` (None: off)."""
    algo = events.engine_hash_algo
    if algo is None:
        return None
    seed = events.engine_hash_seed
    if seed is None and not algo.startswith("xxhash"):
        seed = DEFAULT_SEED  # not the router's own PYTHONHASHSEED: the pods' is what counts
    return EngineHasher(
        algo, seed, lora_paths=events.engine_hash_lora_paths, int_hashes=events.engine_hash_int
    )


def make_sink(index: Any, settings: Settings) -> IndexSink:
    """``scoring.events``' decoder + applier bound to ``index`` (the router app and the
    standalone indexer both build their sink here)."""
    return IndexSink(
        index,
        block_size=settings.block_size,
        fallback_block_size=settings.events.block_size_fallback,
        engine_hasher=build_engine_hasher(settings.events),
        learn_queue=settings.events.engine_hash_queue,
    )


class IndexSink(_ScoringIndexSink):
    def __init__(self, index: Any, *, learn_queue: int = 1024, **applier_kwargs: Any) -> None:
        super().__init__(index, **applier_kwargs)
        self._learn_max = learn_queue
        self._learn_q: asyncio.Queue[_Chain] | None = None
        self._learn_task: asyncio.Task[None] | None = None
        self.learn_requests = 0
        self.learn_dropped = 0
        self.learn_errors = 0
        #: LoRA chains not learned: the adapter's path is neither configured nor known
        self.learn_lora_unknown = 0
        #: adapter name -> the path the pods report for it (the app sets the scraper's
        #: lookup); configured paths (``events.engine_hash_lora_paths``) win
        self.lora_path_of: Callable[[str], str | None] | None = None
        #: engine-hash mode has two writers (events and learned links): their index
        #: writes go out in the order the applier computed them (an asyncio.Lock is
        #: FIFO, and ops are computed and queued for it without a yield in between), so
        #: a link computed before a removal can never land after it
        self._write_order: asyncio.Lock | None = (
            asyncio.Lock() if self.applier.hasher is not None else None
        )
        #: told what the applied events say (speculative entries); set by the core
        self.learner: RouteLearner | None = None
        #: pod -> engine hash -> our key of the GPU blocks carried over at a resync
        self._carried: dict[str, dict[EngineHash, int]] = {}

    async def _run(self, ops: IndexOps) -> None:
        if self._write_order is None:
            await super()._run(ops)
            return
        async with self._write_order:
            await super()._run(ops)

    async def apply_checked(
        self, pod: str, model: str, batch: EventBatch, facts: PodFacts | None
    ) -> int:
        """:meth:`apply`, unless the pod would then hold more distinct GPU blocks than
        ``facts.capacity_blocks``: raises :class:`~router.events.guard.BatchRejected`
        before any index write (the applier has counted the batch: the caller clears
        the pod)."""
        ops = self.prepare_checked(pod, model, batch, facts)
        await self._run(ops)
        self.applied(pod, batch, ops)  # (the speculative entries hear every batch)
        return len(batch.events)

    def prepare_checked(
        self, pod: str, model: str, batch: EventBatch, facts: PodFacts | None
    ) -> IndexOps:
        """The first half of :meth:`apply_checked`, without a yield: the applier takes
        the batch and returns the index writes it makes (raises ``BatchRejected`` as
        :meth:`apply_checked` does).  The writer prepares several consecutive batches of
        a pod, then runs their writes in one :meth:`write` (one Redis round trip) and
        tells :meth:`applied` of each."""
        st = self.applier.pod(pod)
        # the pod's scraped block size (vllm:cache_config_info) interprets its events
        bs = facts.block_size if facts is not None else None
        if st is None or st.model != model or (bs and st.block_size != bs):
            st = self.applier.set_pod(pod, model, bs)
        ops = self.applier.apply_batch(pod, batch)
        check_held(st.gpu_blocks, facts)
        return ops

    async def write(self, ops: IndexOps) -> None:
        """Run prepared index writes (in the applier's order, see ``_write_order``)."""
        await self._run(ops)

    # -- what the speculative entries hear ----------------------------------------------

    def applied(self, pod: str, batch: EventBatch, ops: IndexOps) -> None:
        learner = self.learner
        if learner is None:
            return
        learner.published(pod)
        self._tell(learner, ops)
        carried = self._carried.get(pod)
        if carried is not None:
            self._carried_events(learner, pod, carried, batch)
        st = self.applier.pod(pod)
        if st is not None and st.orphans:
            learner.incomplete(pod)

    def _carried_events(
        self,
        learner: RouteLearner,
        pod: str,
        carried: dict[EngineHash, int],
        batch: EventBatch,
    ) -> None:
        """Events about blocks carried over at a resync: a removal drops the entry; a
        store means the engine announces the block again (no longer ours to track)."""
        gone: list[int] = []
        for ev in batch.events:
            if type(ev) is BlockRemoved:
                if ev.medium is None or ev.medium == FAST_TIER:
                    for h in ev.block_hashes:
                        k = carried.pop(h, None)
                        if k is not None:
                            gone.append(k)
            elif type(ev) is BlockStored:
                for h in ev.block_hashes:
                    carried.pop(h, None)
            elif type(ev) is AllBlocksCleared:
                carried.clear()
        if gone:
            learner.removed(pod, gone)
        if not carried or not learner.index.holds(pod):
            del self._carried[pod]

    def _tell(self, learner: RouteLearner, ops: IndexOps) -> None:
        tier = self.index.tiers[0]
        for kind, p, t, keys in ops.ops:
            if kind == "add":
                if t == tier:
                    learner.stored(p, keys)
            elif kind == "remove":
                if t == tier:
                    learner.removed(p, keys)
            elif kind == "clear":  # AllBlocksCleared within a batch
                learner.all_cleared(p)

    async def clear_pod(self, pod: str) -> None:
        """A resync (the subscriber lost the pod's events or saw it restart): forget its
        entries, carrying its GPU blocks over into speculative entries (an engine
        restart is told apart later by the pod's hit counter going back); the pod
        learns from routed requests until its index is whole again."""
        learner = self.learner
        held = self._gpu_blocks(pod) if learner is not None else {}
        await super().clear_pod(pod)
        if learner is not None:
            if held:
                self._carried.setdefault(pod, {}).update(held)
            learner.cleared(pod, list(held.values()))

    def _gpu_blocks(self, pod: str) -> dict[EngineHash, int]:
        """Engine hash -> our key of the blocks the applier knows ``pod`` holds on GPU."""
        st = self.applier.pod(pod)
        if st is None:
            return {}
        out: dict[EngineHash, int] = {}
        for h, v in st.blocks.items():
            if type(v) is int:
                out[h] = v
            elif isinstance(v, Held) and v.counts.get(FAST_TIER):
                out[h] = v.key
        return out

    async def remove_pod(self, pod: str) -> None:
        await super().remove_pod(pod)
        self._carried.pop(pod, None)
        if self.learner is not None:
            self.learner.gone(pod)

    def lost_events(self, pod: str) -> bool:
        st = self.applier.pod(pod)
        return bool(st is not None and st.lost)

    # -- engine-hash mode ------------------------------------------------------------

    @property
    def learning(self) -> bool:
        """Engine-hash mode is configured and has not switched itself off."""
        h = self.applier.hasher
        return h is not None and h.enabled

    def start_learning(self) -> None:
        """Start the task that learns routed chains (no-op unless engine-hash mode)."""
        if self.applier.hasher is None or self._learn_task is not None:
            return
        self._learn_q = asyncio.Queue(self._learn_max)
        self._learn_task = asyncio.create_task(self._learn_loop(), name="engine-hash-learn")

    async def stop_learning(self) -> None:
        task, self._learn_task = self._learn_task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._learn_q = None

    def learn_later(
        self,
        model: str,
        token_ids: Sequence[int],
        block_size: int,
        our_keys: Sequence[int],
        *,
        lora: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        """Queue a routed request's chain to be learned; never raises, never blocks."""
        q = self._learn_q
        if q is None or not our_keys or not self.learning:
            return
        try:
            # references, not copies: the request path pays only the put
            q.put_nowait((model, token_ids, block_size, our_keys, lora, cache_salt))
        except asyncio.QueueFull:
            self.learn_dropped += 1

    async def _learn_loop(self) -> None:
        q = self._learn_q
        assert q is not None
        while True:
            model, ids, bs, keys, lora, salt = await q.get()
            if lora and not self._knows_lora_path(lora):
                self.learn_lora_unknown += 1
                continue
            try:
                ops = self.applier.learn(
                    model, list(ids), bs, our_keys=list(keys), lora=lora, cache_salt=salt
                )
                self.learn_requests += 1
                if ops:
                    await self._run(ops)
                    if self.learner is not None:
                        self._tell(self.learner, ops)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.learn_errors += 1
                log.warning("engine-hash learn failed: %s", exc)
            await asyncio.sleep(0)  # a burst of learning never holds the loop

    def _knows_lora_path(self, lora: str) -> bool:
        """Whether the hasher has ``lora``'s path, taking it from the pods' reports
        when it was not configured (the events of that adapter verify from then on)."""
        h = self.applier.hasher
        if h is None:
            return False
        if lora in h.lora_paths:
            return True
        path = self.lora_path_of(lora) if self.lora_path_of is not None else None
        if not path:
            return False
        h.lora_paths[lora] = path
        return True

    def extra_stats(self) -> dict[str, int]:
        """Counters exported as ``kvroute_event_applier_*`` next to the applier's."""
        h = self.applier.hasher
        if h is None:
            return {}
        return {
            "engine_hash_matches": h.matches,
            "engine_hash_mismatches": h.mismatches,
            "engine_hash_unverifiable": h.unverifiable,
            "engine_hash_learned_requests": self.learn_requests,
            "engine_hash_learn_dropped": self.learn_dropped,
            "engine_hash_learn_errors": self.learn_errors,
            "engine_hash_lora_unknown": self.learn_lora_unknown,
        }

    def gauges(self) -> dict[str, float]:
        """Gauges exported as ``kvroute_event_*``."""
        h = self.applier.hasher
        if h is None:
            return {}
        q = self._learn_q
        return {
            "engine_hash_enabled": 1.0 if h.enabled else 0.0,
            "engine_hash_learned_blocks": float(h.learned_blocks),
            "engine_hash_learn_queue_depth": float(q.qsize() if q is not None else 0),
        }
