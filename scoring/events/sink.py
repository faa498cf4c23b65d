"""The decoder + applier bound to one index: what the router's KV-event subscriber feeds
(``router.events.subscriber.EventSink``)."""

from __future__ import annotations

from scoring.events.apply import ApplierStats, IndexOps, KVEventApplier
from scoring.events.decode import EventBatch, decode_batch
from scoring.index.base import BlockIndex


class IndexSink:
    """Decodes vLLM batches and applies them to ``index`` through a
    :class:`KVEventApplier` (created with ``applier_kwargs`` unless given)."""

    def __init__(
        self, index: BlockIndex, applier: KVEventApplier | None = None, **applier_kwargs: object
    ) -> None:
        self.index = index
        self.applier = applier if applier is not None else KVEventApplier(**applier_kwargs)  # type: ignore[arg-type]

    @property
    def stats(self) -> ApplierStats:
        return self.applier.stats

    def decode(self, payload: bytes) -> EventBatch:
        """Decode one payload; raises :class:`~scoring.events.decode.DecodeError` (a
        ``ValueError``) when it is not a batch, after counting it."""
        try:
            return decode_batch(payload)
        except ValueError:
            self.applier.stats.decode_errors += 1
            raise

    async def _run(self, ops: IndexOps) -> None:
        # Through the async protocol even for the in-memory index: consecutive writes
        # are merged, so a batch costs a few awaits, and a wrapped index (metrics,
        # tracing, a test's stall) sees every write.
        await ops.apply(self.index)

    async def apply(self, pod: str, model: str, batch: EventBatch) -> int:
        """Apply ``batch`` published by ``pod`` serving ``model``; returns #events."""
        st = self.applier.pod(pod)
        if st is None or st.model != model:
            self.applier.set_pod(pod, model)
        ops = self.applier.apply_batch(pod, batch)
        await self._run(ops)
        self.applied(pod, batch, ops)
        return len(batch.events)

    def applied(self, pod: str, batch: EventBatch, ops: IndexOps) -> None:
        """Called with each batch of ``pod``'s events and the index writes it made, once
        they are applied (a subclass watches them; here nothing)."""

    async def clear_pod(self, pod: str) -> None:
        """Forget the pod's entries (index and the applier's engine-hash map)."""
        await self._run(self.applier.clear_pod(pod))

    async def remove_pod(self, pod: str) -> None:
        """The pod left the fleet: forget its entries and the applier's state for it."""
        await self._run(self.applier.remove_pod(pod))

    def needs_resync(self, pod: str) -> bool:
        """Orphans wait for a parent or events of ``pod`` were lost (see
        :attr:`scoring.events.PodEvents.needs_resync`)."""
        st = self.applier.pod(pod)
        return st is not None and st.needs_resync
