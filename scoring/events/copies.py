"""Counting a pod's copies of each block per tier, and the index writes that follow.

:class:`BlockCopies` is the bookkeeping half of
:class:`~scoring.events.apply.KVEventApplier` (whose docstring states the semantics): one
more copy per stored block, one less per removed one, the index told of a (hash, tier)
going 0 -> 1 or 1 -> 0, and the oldest blocks forgotten past ``max_blocks_per_pod``.
"""

from __future__ import annotations

import logging

from scoring.events.decode import BlockRemoved, BlockStored, EngineHash
from scoring.events.ops import IndexOps
from scoring.events.registry import PodRegistry
from scoring.events.state import FAST_TIER, Held, PodEvents

#: the applier's logger (these methods were part of :mod:`scoring.events.apply`)
log = logging.getLogger("scoring.events.apply")


class BlockCopies(PodRegistry):
    """Per-pod copy counts of blocks per tier (see the module docstring)."""

    def _bad(self, st: PodEvents, msg: str) -> None:
        # not a warning per event: a batch of 10,000 bad events would write 10,000 lines;
        # the caller sees ``lost`` and logs (rate-limited) with ``last_error``
        self.stats.bad_events += 1
        self.stats.last_error = f"pod {st.pod}: {msg}"
        st.lost = True
        log.debug("skipping KV event from pod %s: %s", st.pod, msg)

    def _tier(self, st: PodEvents, medium: str | None) -> str | None:
        if medium is None:
            return "GPU"
        tier = self.medium_tiers.get(medium)
        if tier is None:
            self._bad(st, f"unknown medium {medium!r} (known: {sorted(self.medium_tiers)})")
        return tier

    def _record(
        self,
        st: PodEvents,
        hashes: list[EngineHash],
        keys: list[int],
        tier: str,
        ops: IndexOps,
        linking: bool = False,
    ) -> None:
        """Count one more copy of each block in ``tier``; the index hears of the
        blocks whose count in that tier went 0 -> 1.  ``linking``: the blocks come from
        an orphan, and removals that arrived while it waited cancel copies."""
        blocks = st.blocks
        pending = st.orphan_removed if linking else None
        new: list[int] = []
        fast = tier == FAST_TIER
        for h, k in zip(hashes, keys, strict=True):
            if pending and h in pending:
                n = pending.pop(h) - 1
                if n:
                    pending[h] = n
                continue
            v = blocks.get(h)
            if v is None:
                blocks[h] = k if fast else Held(k, {tier: 1})
                new.append(k)
            elif type(v) is int:
                if fast:
                    blocks[h] = Held(v, {FAST_TIER: 2})
                else:
                    blocks[h] = Held(v, {FAST_TIER: 1, tier: 1})
                    new.append(v)
            else:
                counts = v.counts  # type: ignore[union-attr]
                c = counts.get(tier, 0)
                counts[tier] = c + 1
                if not c:
                    new.append(v.key)  # type: ignore[union-attr]
        ops.add(st.pod, tier, new)
        if fast:
            st.gpu_blocks += len(new)
        if len(blocks) > self.max_blocks_per_pod:
            self._evict(st, ops)

    def _record_known(self, st: PodEvents, ev: BlockStored, tier: str, ops: IndexOps) -> None:
        """A BlockStored without tokens (offload placeholder): only known hashes count."""
        hashes: list[EngineHash] = []
        keys: list[int] = []
        for h in ev.block_hashes:
            k = st.key_of(h)
            if k is None:
                self.stats.unresolved_blocks += 1
            else:
                hashes.append(h)
                keys.append(k)
        if hashes:
            self._record(st, hashes, keys, tier, ops)
            self.stats.stored_blocks += len(hashes)

    def _evict(self, st: PodEvents, ops: IndexOps) -> None:
        over = len(st.blocks) - self.max_blocks_per_pod + max(1, self.max_blocks_per_pod // 100)
        victims: list[EngineHash] = []
        for h in st.blocks:  # oldest stored first
            if len(victims) >= over:
                break
            victims.append(h)
        for h in victims:
            v = st.blocks.pop(h)
            if type(v) is int:
                st.gpu_blocks -= 1
                ops.remove(st.pod, FAST_TIER, (v,))
            else:
                if FAST_TIER in v.counts:  # type: ignore[union-attr]
                    st.gpu_blocks -= 1
                for tier in v.counts:  # type: ignore[union-attr]
                    ops.remove(st.pod, tier, (v.key,))  # type: ignore[union-attr]
        self.stats.evicted_blocks += len(victims)

    # -- BlockRemoved ----------------------------------------------------------------

    def _removed(self, st: PodEvents, ev: BlockRemoved, ops: IndexOps) -> None:
        tier = self._tier(st, ev.medium)
        if tier is None:
            return
        self.stats.removed_blocks += len(ev.block_hashes)
        blocks = st.blocks
        fast = tier == FAST_TIER
        gone: list[int] = []
        for h in ev.block_hashes:
            v = blocks.get(h)
            if v is not None and type(v) is int:
                if fast:
                    del blocks[h]
                    gone.append(v)
                else:
                    self._unknown_removal(st, h)
                continue
            if v is None:
                self._unknown_removal(st, h)
                continue
            counts = v.counts  # type: ignore[union-attr]
            c = counts.get(tier)
            if not c:
                self._unknown_removal(st, h)
                continue
            if c > 1:
                counts[tier] = c - 1
                continue
            del counts[tier]
            gone.append(v.key)  # type: ignore[union-attr]
            if not counts:
                del blocks[h]
            elif counts == {FAST_TIER: 1}:
                blocks[h] = v.key  # type: ignore[union-attr]  # back to the compact form
        ops.remove(st.pod, tier, gone)
        if fast:
            st.gpu_blocks -= len(gone)

    def _unknown_removal(self, st: PodEvents, h: EngineHash) -> None:
        if st.orphans and any(h in ev.block_hashes for evs in st.orphans.values() for ev in evs):
            st.orphan_removed[h] = st.orphan_removed.get(h, 0) + 1
            return
        self.stats.unknown_removed += 1
