"""KV-event subscription: vLLM publishers -> (seq tracking, replay, resync) -> index.

See :mod:`router.events.subscriber` (sockets, who may speak for a pod) and
:mod:`router.events.writer` (sequence semantics, replays, resyncs; the batches' writes in
:mod:`router.events.writer_batches`).
"""

from router.events.protocol import DecodedBatch, EventSink
from router.events.replay import ReplayError, fetch_replay
from router.events.settings import EventsSettings
from router.events.sink import IndexSink
from router.events.stats import EventStats, EventStatsCollector, PodEventStats
from router.events.subscriber import KVEventSubscriber
from router.events.topic import TopicError, make_topic, parse_topic

__all__ = [
    "DecodedBatch",
    "EventSink",
    "EventStats",
    "EventStatsCollector",
    "EventsSettings",
    "IndexSink",
    "KVEventSubscriber",
    "PodEventStats",
    "ReplayError",
    "TopicError",
    "fetch_replay",
    "make_topic",
    "parse_topic",
]
