"""What the KV-event subscriber feeds: the :class:`EventSink` protocol."""

from __future__ import annotations

from typing import Any, Protocol


class DecodedBatch(Protocol):
    """What the sink's decoder returns: the engine timestamp and the events."""

    @property
    def ts(self) -> float: ...

    @property
    def events(self) -> Any: ...


class EventSink(Protocol):
    """Decodes vLLM batches and applies them to an index (``scoring.events.IndexSink``).

    Optional extensions, used when the sink has them (:class:`router.events.IndexSink`
    does): ``async remove_pod(pod)`` (the pod left: forget it entirely; else
    ``clear_pod``), ``async apply_checked(pod, model, batch, facts)`` (``apply``,
    raising :class:`~router.events.guard.BatchRejected` when the pod would hold more
    than its cache), ``lost_events(pod) -> bool`` (some events had to be skipped:
    resync), ``stats`` (an object with ``as_dict()``, or a callable returning a dict:
    exported as ``kvroute_event_applier_*``), ``extra_stats() -> dict`` (more such
    counters) and ``gauges() -> dict`` (exported as ``kvroute_event_*`` gauges).
    """

    def decode(self, payload: bytes) -> DecodedBatch:
        """Raise ``ValueError`` on a payload that is not a vLLM event batch."""
        ...

    async def apply(self, pod: str, model: str, batch: Any) -> int:
        """Apply ``batch`` as published by ``pod`` serving ``model``; return #events."""
        ...

    async def clear_pod(self, pod: str) -> None:
        """Forget the pod's entries (index and per-pod engine-hash map)."""
        ...
