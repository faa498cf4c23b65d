"""The sink the subscriber feeds: ``scoring.events.IndexSink`` plus one extension.

``scoring.events.IndexSink`` decodes vLLM batches and applies them to a
:class:`~scoring.index.base.BlockIndex` through a ``KVEventApplier`` (engine hash ->
our key per pod, counted stores, orphans).  The base class already has
``remove_pod`` (a pod left the fleet: forget it entirely in the applier too); this
subclass adds what else the subscriber uses when present (see
:class:`~router.events.subscriber.EventSink`):

* :meth:`lost_events` — the applier had to skip some of the pod's events, so the
  subscriber resyncs it.
"""

from __future__ import annotations

from scoring.events import IndexSink as _ScoringIndexSink


class IndexSink(_ScoringIndexSink):
    def lost_events(self, pod: str) -> bool:
        st = self.applier.pod(pod)
        return bool(st is not None and st.lost)
