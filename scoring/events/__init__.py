"""vLLM KV events: decoding (:mod:`.decode`), applying them to a block index
(:mod:`.apply`, on :mod:`.copies`, :mod:`.registry`, :mod:`.state` and the writes of
:mod:`.ops`), and the optional engine-hash mode (:mod:`.engine_hash`)."""

from scoring.events.apply import (
    ApplierStats,
    IndexOps,
    KVEventApplier,
    PodEvents,
    UnknownPodError,
)
from scoring.events.decode import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodeError,
    EngineHash,
    EventBatch,
    decode_batch,
    encode_batch,
    encode_batch_positional,
)
from scoring.events.engine_hash import EngineHasher
from scoring.events.sink import IndexSink

__all__ = [
    "AllBlocksCleared",
    "ApplierStats",
    "BlockRemoved",
    "BlockStored",
    "DecodeError",
    "EngineHash",
    "EngineHasher",
    "EventBatch",
    "IndexOps",
    "IndexSink",
    "KVEventApplier",
    "PodEvents",
    "UnknownPodError",
    "decode_batch",
    "encode_batch",
    "encode_batch_positional",
]
