"""Applying vLLM KV events to a block index: a function of (pod, event).

:class:`KVEventApplier` keeps, per pod, the engine's block hash -> our block key and
the number of stored copies per tier, and turns each event into :class:`IndexOps`
(adds / removes / clears of *our* keys) that the caller runs against any
:class:`~scoring.index.base.BlockIndex` -- synchronously on the in-memory index
(:meth:`IndexOps.apply_sync`), awaited on Redis (:meth:`IndexOps.apply`).

Semantics (the README quotes this):

* **Our keys** come from the ``token_ids`` a ``BlockStored`` carries, through
  :func:`scoring.blocks.chain_keys`: a chain with ``parent_block_hash`` None starts at
  ``root_key(model, lora_name)`` with the ``cache_salt`` found in ``extra_keys[0]`` (the
  first string after the LoRA name, see :mod:`scoring.events.decode`); a chain with a
  known parent continues from the parent's key.  ``model`` is the pod's, given by the
  caller (topic ``kv@<pod>@<model>`` or config).  Block size: the event's
  ``block_size``, else the pod's (:attr:`PodEvents.block_size`: given by the caller from
  the pod's ``vllm:cache_config_info`` or configured, else learned from the pod's first
  event that names one), else ``fallback_block_size`` (a guess, for engines whose events
  omit it: never taken for the pod's size).  An event naming a size other than the
  pod's known one is counted (``block_size_mismatches``); the fallback never is.  An
  event whose token count is not ``len(block_hashes) * block_size`` is malformed
  (counted, skipped).
* **Counting**: the same hash stored twice on a pod counts 2 (vLLM does not dedupe
  physical blocks); ``BlockRemoved`` takes one copy per listed hash; the index sees one
  ``add`` when a (hash, tier) goes 0 -> 1 and one ``remove`` when it goes 1 -> 0.  A
  removal of a hash we never saw is counted (``unknown_removed``) and ignored.  Copies
  are counted across KV-cache groups (``group_idx``; hybrid models store a block once
  per group), so a block stays indexed while any group holds it.  A per-request
  ``kv_cache_report_mode="full"`` (vLLM re-announcing prefix-cache *hits* as
  BlockStored) would inflate counts; the default "incremental" mode does not.
  :attr:`PodEvents.gpu_blocks` counts the distinct blocks held in the GPU tier (the
  pod's GPU entries in the index): a consistent stream keeps it at most the engine's
  ``num_gpu_blocks`` (the router refuses batches that exceed it).
* **Tiers**: ``medium`` "GPU" (or absent) -> tier "GPU", "CPU" -> "CPU", "STORAGE" /
  "DISK" -> "DISK"; an unknown medium is counted (``bad_events``) and skipped.  An
  offload ``BlockStored`` without tokens (a placeholder naming known hashes) records the
  copy for the hashes we know and counts the others (``unresolved_blocks``).
* ``AllBlocksCleared`` forgets the pod (every tier) and its orphans.
* **Orphans** (llm-d bug #372: a ``BlockStored`` whose parent we never saw, after a
  missed event or a late join) are never dropped silently: their blocks are counted
  (``orphaned_blocks``), the event is kept in a bounded per-pod buffer keyed by the
  parent's engine hash, and the pod is flagged :attr:`PodEvents.needs_resync`.  The
  orphan is linked (``orphans_linked``) as soon as its parent becomes known: the parent
  is stored later (e.g. by a replay), or -- in engine-hash mode -- the parent's hash was
  learned from a request's tokens (:meth:`KVEventApplier.learn`), in which case the
  learned ancestors are indexed too (the engine holds them: its cache is prefix-closed)
  and counted in ``engine_hash_linked``.  When the buffer is full the oldest orphans
  are dropped (``orphans_dropped``); ``needs_resync`` then stays set until the caller
  has cleared / replayed the pod and calls :meth:`KVEventApplier.mark_resynced`.
  A ``BlockRemoved`` of a block that sits in a waiting orphan is remembered and cancels
  that copy when the orphan is linked, so a late link never indexes an evicted block.
* **Engine-hash mode** (optional :class:`~scoring.events.engine_hash.EngineHasher`): every
  ``BlockStored`` is re-hashed and checked against the engine's hashes; a mismatch
  disables the mode loudly (see that module).
* **Bounds**: at most ``max_blocks_per_pod`` hashes per pod (oldest stored forgotten
  first, ``evicted_blocks``) and ``max_orphan_blocks`` orphaned blocks per pod.
"""

from __future__ import annotations

import logging

from scoring.blocks import chain_keys, root_key
from scoring.events.copies import BlockCopies
from scoring.events.decode import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    EngineHash,
    EventBatch,
    decode_batch,
)
from scoring.events.ops import IndexOps, SyncIndex
from scoring.events.registry import DEFAULT_MEDIUM_TIERS, UnknownPodError
from scoring.events.state import FAST_TIER, ApplierStats, Held, PodEvents

__all__ = [
    "DEFAULT_MEDIUM_TIERS",
    "FAST_TIER",
    "ApplierStats",
    "Held",
    "IndexOps",
    "KVEventApplier",
    "PodEvents",
    "SyncIndex",
    "UnknownPodError",
]

log = logging.getLogger(__name__)


def _cache_salt(ev: BlockStored) -> str | None:
    """The cache_salt in block 0's untagged extra keys (after the LoRA name, if any)."""
    if not ev.extra_keys:
        return None
    first = ev.extra_keys[0]
    if not first or not isinstance(first, (list, tuple)):
        return None
    items = list(first)
    if ev.lora_name and items and items[0] == ev.lora_name:
        items = items[1:]
    for x in items:
        if isinstance(x, str):
            return x
    return None


class KVEventApplier(BlockCopies):
    """Turns (pod, event) into index writes; see the module docstring (the copy counting
    is :class:`~scoring.events.copies.BlockCopies`)."""

    # -- entry points ----------------------------------------------------------------

    def ingest(self, pod: str, payload: bytes) -> IndexOps:
        """Decode one payload and apply it.  An undecodable payload is counted
        (``decode_errors``), flags the pod for resync, and yields no writes."""
        st = self._state(pod)
        try:
            batch = decode_batch(payload)
        except DecodeError as exc:
            self.stats.decode_errors += 1
            self.stats.last_error = f"pod {pod}: {exc}"
            st.lost = True
            log.warning("undecodable KV-event payload from pod %s: %s", pod, exc)
            return IndexOps()
        return self.apply_batch(pod, batch)

    def ingest_sync(self, index: SyncIndex, pod: str, payload: bytes) -> None:
        """``ingest`` and run the writes on an index with a sync fast path."""
        self.ingest(pod, payload).apply_sync(index)

    def apply_batch(self, pod: str, batch: EventBatch) -> IndexOps:
        st = self._state(pod)
        self.stats.batches += 1
        if batch.unknown:
            self.stats.unknown_events += batch.unknown
        for err in batch.errors:
            self._bad(st, err)
        ops = IndexOps()
        traced = False
        for i, ev in enumerate(batch.events):
            try:
                self._apply(st, ev, ops)
            except Exception as exc:  # an input we did not foresee must not stop ingest
                if not traced:  # one traceback per batch, not one per event
                    traced = True
                    log.exception("pod %s: event %d of a batch could not be applied", pod, i)
                self._bad(st, f"event {i} ({type(ev).__name__}) could not be applied: {exc!r}")
        return ops

    def apply(self, pod: str, event: BlockStored | BlockRemoved | AllBlocksCleared) -> IndexOps:
        """Apply one decoded event of ``pod``."""
        ops = IndexOps()
        self._apply(self._state(pod), event, ops)
        return ops

    def _apply(self, st: PodEvents, ev: object, ops: IndexOps) -> None:
        if isinstance(ev, BlockStored):
            self._stored(st, ev, ops)
        elif isinstance(ev, BlockRemoved):
            self._removed(st, ev, ops)
        elif isinstance(ev, AllBlocksCleared):
            self.stats.cleared += 1
            self._reset(st)
            ops.clear(st.pod)
        else:
            self._bad(st, f"not a KV event: {type(ev).__name__}")

    # -- BlockStored -----------------------------------------------------------------

    def _stored(self, st: PodEvents, ev: BlockStored, ops: IndexOps, linking: bool = False) -> None:
        tier = self._tier(st, ev.medium)
        if tier is None:
            return
        hashes = ev.block_hashes
        n = len(hashes)
        if n == 0:
            return
        tokens = ev.token_ids
        if not tokens:
            self._record_known(st, ev, tier, ops)
            return
        named = ev.block_size
        bs = named or st.block_size or self.fallback_block_size
        if not bs or bs <= 0 or len(tokens) != bs * n:
            self._bad(
                st,
                f"BlockStored has {n} hashes and {len(tokens)} tokens, not {n} x block_size ({bs})",
            )
            return
        if named:  # only a size the event names is evidence of the pod's
            if st.block_size is None:
                st.block_size = named
            elif named != st.block_size:
                self.stats.block_size_mismatches += 1
        ph = ev.parent_block_hash
        salt = None
        if ph is None:
            salt = _cache_salt(ev)
            parent = root_key(st.model, ev.lora_name)
        else:
            parent = st.key_of(ph)  # type: ignore[assignment]
            if parent is None and self.hasher is not None:
                parent = self._link_learned(st, ph, tier, ops)
            if parent is None:
                self._orphan(st, ph, ev)
                return
        if self.hasher is not None:
            self.hasher.verify(ev)
        try:
            keys = chain_keys(tokens, bs, parent=parent, lora=ev.lora_name, cache_salt=salt)
        except ValueError as exc:
            self._bad(st, f"BlockStored token ids: {exc}")
            return
        self._record(st, hashes, keys, tier, ops, linking)
        self.stats.stored_blocks += n
        if st.orphans:
            self._link_children(st, hashes, ops)

    # -- orphans ---------------------------------------------------------------------

    def _link_children(self, st: PodEvents, hashes: list[EngineHash], ops: IndexOps) -> None:
        """Apply orphans waiting for any of ``hashes`` (now known)."""
        for h in hashes:
            if h in st.orphans:
                for ev in self._take_orphans(st, h):
                    self.stats.orphans_linked += len(ev.block_hashes)
                    self._stored(st, ev, ops, linking=True)
        if not st.orphans:
            st.orphan_removed.clear()

    def _link_learned(
        self, st: PodEvents, parent: EngineHash, tier: str, ops: IndexOps
    ) -> int | None:
        """Resolve ``parent`` from request chains learned by the engine hasher; index
        its learned ancestors on this pod (the engine holds them) and return its key."""
        assert self.hasher is not None
        chain = self.hasher.ancestry(st.model, parent)
        if not chain:
            return None
        missing = [(h, k) for h, k in chain if h not in st.blocks]
        if missing:
            self._record(st, [h for h, _ in missing], [k for _, k in missing], tier, ops)
            self.stats.engine_hash_linked += len(missing)
        return chain[-1][1]

    def learn(
        self,
        model: str,
        token_ids: list[int],
        block_size: int,
        *,
        our_keys: list[int] | None = None,
        lora: str | None = None,
        cache_salt: str | None = None,
    ) -> IndexOps:
        """Engine-hash mode: learn a routed request's chain (see
        :meth:`EngineHasher.learn`) and link any orphans waiting for its blocks."""
        ops = IndexOps()
        if self.hasher is None:
            return ops
        learned = self.hasher.learn(
            model, token_ids, block_size, our_keys=our_keys, lora=lora, cache_salt=cache_salt
        )
        if not learned or not self._orphan_pods:
            return ops
        hashes = [h for h, _ in learned]
        for pod in list(self._orphan_pods):
            st = self._pods[pod]
            if st.model == model:
                self._link_children(st, hashes, ops)
        return ops
