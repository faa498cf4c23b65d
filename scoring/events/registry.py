"""The registry of :class:`~scoring.events.apply.KVEventApplier`: its settings, its
counters, the pods it knows (registering, clearing, the resync flags) and their orphan
buffers."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from scoring.events.decode import BlockStored, EngineHash
from scoring.events.engine_hash import EngineHasher
from scoring.events.ops import IndexOps
from scoring.events.state import ApplierStats, PodEvents

log = logging.getLogger(__name__)

DEFAULT_MEDIUM_TIERS: Mapping[str, str] = {
    "GPU": "GPU",
    "CPU": "CPU",
    "STORAGE": "DISK",
    "DISK": "DISK",
}


class UnknownPodError(KeyError):
    """Events arrived for a pod the applier was not told about (``set_pod``)."""


class PodRegistry:
    """What an applier is configured with and knows of each pod; the events'
    semantics are :class:`~scoring.events.apply.KVEventApplier`'s."""

    def __init__(
        self,
        *,
        block_size: int | None = None,
        fallback_block_size: int | None = None,
        engine_hasher: EngineHasher | None = None,
        medium_tiers: Mapping[str, str] = DEFAULT_MEDIUM_TIERS,
        max_orphan_blocks: int = 8192,
        max_blocks_per_pod: int = 4_000_000,
    ) -> None:
        if block_size is not None and block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if fallback_block_size is not None and fallback_block_size <= 0:
            raise ValueError(f"fallback_block_size must be positive, got {fallback_block_size}")
        #: every pod's block size, when configured (else each pod's is given or learned)
        self.block_size = block_size
        #: for an event without ``block_size`` from a pod whose size is unknown
        self.fallback_block_size = fallback_block_size
        self.hasher = engine_hasher
        self.medium_tiers = dict(medium_tiers)
        self.max_orphan_blocks = max_orphan_blocks
        self.max_blocks_per_pod = max_blocks_per_pod
        self.stats = ApplierStats()
        self._pods: dict[str, PodEvents] = {}
        self._orphan_pods: set[str] = set()

    # -- pods ------------------------------------------------------------------------

    def set_pod(self, pod: str, model: str, block_size: int | None = None) -> PodEvents:
        """Register ``pod`` serving ``model`` (keeps its state if already known)."""
        st = self._pods.get(pod)
        if st is None:
            st = PodEvents(pod, model, block_size or self.block_size)
            self._pods[pod] = st
        else:
            st.model = model
            if block_size:
                st.block_size = block_size
        return st

    def pod(self, pod: str) -> PodEvents | None:
        return self._pods.get(pod)

    def pods(self) -> list[PodEvents]:
        return list(self._pods.values())

    def pods_needing_resync(self) -> list[str]:
        return [p.pod for p in self._pods.values() if p.needs_resync]

    def clear_pod(self, pod: str) -> IndexOps:
        """Forget what ``pod`` holds (engine restart, resync); keeps it registered."""
        ops = IndexOps()
        st = self._pods.get(pod)
        if st is not None:
            self._reset(st)
        ops.clear(pod)
        return ops

    def remove_pod(self, pod: str) -> IndexOps:
        """The pod left the fleet: forget it entirely."""
        ops = self.clear_pod(pod)
        self._pods.pop(pod, None)
        self._orphan_pods.discard(pod)
        return ops

    def mark_resynced(self, pod: str) -> None:
        """The caller replayed or re-learned ``pod``: clear the lost-events flag."""
        st = self._pods.get(pod)
        if st is not None:
            st.lost = False

    def _reset(self, st: PodEvents) -> None:
        st.blocks.clear()
        st.orphans.clear()
        st.orphan_blocks = 0
        st.orphan_removed.clear()
        st.lost = False
        st.gpu_blocks = 0
        self._orphan_pods.discard(st.pod)

    def _state(self, pod: str) -> PodEvents:
        st = self._pods.get(pod)
        if st is None:
            raise UnknownPodError(f"KV events for unknown pod {pod!r}: call set_pod() first")
        return st

    # -- the orphan buffer -------------------------------------------------------------

    def _orphan(self, st: PodEvents, parent: EngineHash, ev: BlockStored) -> None:
        n = len(ev.block_hashes)
        self.stats.orphaned_blocks += n
        st.orphans.setdefault(parent, []).append(ev)
        st.orphan_blocks += n
        self._orphan_pods.add(st.pod)
        while st.orphan_blocks > self.max_orphan_blocks and st.orphans:
            oldest = next(iter(st.orphans))
            dropped = sum(len(e.block_hashes) for e in st.orphans.pop(oldest))
            st.orphan_blocks -= dropped
            self.stats.orphans_dropped += dropped
            st.lost = True
        if not st.orphans:
            self._orphan_pods.discard(st.pod)
        log.debug("pod %s: %d orphaned blocks wait for parent %r", st.pod, n, parent)

    def _take_orphans(self, st: PodEvents, parent: EngineHash) -> list[BlockStored]:
        evs = st.orphans.pop(parent, None)
        if not evs:
            return []
        st.orphan_blocks -= sum(len(e.block_hashes) for e in evs)
        if not st.orphans:
            self._orphan_pods.discard(st.pod)
        return evs
