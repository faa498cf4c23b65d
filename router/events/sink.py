"""The glue between the subscriber and ``scoring.events``: decode, apply, write.

:class:`IndexSink` implements :class:`~router.events.subscriber.EventSink` with
``scoring.events``' decoder and :class:`~scoring.events.KVEventApplier` (engine hash
-> our key per pod, counted stores, orphans) and runs the resulting
:class:`~scoring.events.IndexOps` on any :class:`~scoring.index.base.BlockIndex` —
through the synchronous fast path when the index has one (in-memory), awaited
otherwise (Redis).
"""

from __future__ import annotations

from typing import Any

from scoring.events import EventBatch, IndexOps, KVEventApplier, decode_batch
from scoring.index.base import BlockIndex


class IndexSink:
    """Decodes vLLM batches and applies them to ``index`` through ``applier``."""

    def __init__(
        self,
        index: BlockIndex,
        applier: KVEventApplier | None = None,
        *,
        block_size: int | None = None,
    ) -> None:
        self.index = index
        self.applier = applier or KVEventApplier(block_size=block_size)
        self._sync = all(
            callable(getattr(index, m, None)) for m in ("add_sync", "remove_sync", "clear_pod_sync")
        )

    async def _run(self, ops: IndexOps) -> None:
        if self._sync:
            ops.apply_sync(self.index)  # type: ignore[arg-type]
        else:
            await ops.apply(self.index)

    def decode(self, payload: bytes) -> EventBatch:
        """``scoring.events.decode_batch`` (raises ``DecodeError``, a ``ValueError``)."""
        return decode_batch(payload)

    async def apply(self, pod: str, model: str, batch: Any) -> int:
        st = self.applier.pod(pod)
        if st is None or st.model != model:
            self.applier.set_pod(pod, model)
        await self._run(self.applier.apply_batch(pod, batch))
        return len(batch.events)

    async def clear_pod(self, pod: str) -> None:
        await self._run(self.applier.clear_pod(pod))

    async def remove_pod(self, pod: str) -> None:
        await self._run(self.applier.remove_pod(pod))

    def lost_events(self, pod: str) -> bool:
        """The applier saw events of ``pod`` it had to skip (bad events): resync."""
        st = self.applier.pod(pod)
        return bool(st is not None and st.lost)

    def pod_stats(self, pod: str) -> dict[str, Any]:
        st = self.applier.pod(pod)
        if st is None:
            return {}
        return {
            "orphan_blocks": st.orphan_blocks,
            "needs_resync": st.needs_resync,
            "block_size": st.block_size,
            "blocks": len(st.keys),
        }

    def stats(self) -> dict[str, Any]:
        """The applier's counters (``ApplierStats``), for metrics."""
        return self.applier.stats.as_dict()
