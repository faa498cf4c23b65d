"""The sink the subscriber feeds: ``scoring.events.IndexSink`` plus two extensions.

``scoring.events.IndexSink`` decodes vLLM batches and applies them to a
:class:`~scoring.index.base.BlockIndex` through a ``KVEventApplier`` (engine hash ->
our key per pod, counted stores, orphans).  This subclass adds what the subscriber
uses when present (see :class:`~router.events.subscriber.EventSink`):

* :meth:`remove_pod` — a pod left the fleet: forget it entirely in the applier too;
* :meth:`lost_events` — the applier had to skip some of the pod's events, so the
  subscriber resyncs it.
"""

from __future__ import annotations

from scoring.events import IndexSink as _ScoringIndexSink


class IndexSink(_ScoringIndexSink):
    async def remove_pod(self, pod: str) -> None:
        await self._run(self.applier.remove_pod(pod))

    def lost_events(self, pod: str) -> bool:
        st = self.applier.pod(pod)
        return bool(st is not None and st.lost)
