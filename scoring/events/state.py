"""What :class:`~scoring.events.apply.KVEventApplier` keeps: each pod's engine cache
(:class:`PodEvents`, :class:`Held`) and the applier's counters (:class:`ApplierStats`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from scoring.events.decode import BlockStored, EngineHash

#: the tier of vLLM's own KV cache ("GPU" also on CPU engines)
FAST_TIER = "GPU"


@dataclass(slots=True)
class ApplierStats:
    """Counters the router exports as metrics (blocks unless the name says events)."""

    batches: int = 0
    stored_blocks: int = 0
    removed_blocks: int = 0
    cleared: int = 0  # AllBlocksCleared events
    orphaned_blocks: int = 0
    orphans_linked: int = 0
    orphans_dropped: int = 0
    engine_hash_linked: int = 0  # ancestors indexed from learned engine hashes
    unknown_removed: int = 0
    unresolved_blocks: int = 0
    evicted_blocks: int = 0
    block_size_mismatches: int = 0
    decode_errors: int = 0  # whole payloads that could not be decoded
    bad_events: int = 0  # events skipped as malformed / unusable
    unknown_events: int = 0  # events of an unknown type, skipped
    last_error: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class Held:
    """Stored copies of one block on a pod beyond the common case (one GPU copy)."""

    __slots__ = ("counts", "key")

    def __init__(self, key: int, counts: dict[str, int]) -> None:
        self.key = key
        #: tier -> stored copies (> 0)
        self.counts = counts

    def __repr__(self) -> str:
        return f"Held({self.key}, {self.counts})"


def _key(v: int | Held) -> int:
    return v if type(v) is int else v.key  # type: ignore[union-attr]


@dataclass(slots=True)
class PodEvents:
    """What the applier knows about one pod's engine cache."""

    pod: str
    model: str
    block_size: int | None = None
    #: engine hash -> our key (exactly one copy, in the GPU tier: the common case, kept
    #: as a bare int to save memory) or a :class:`Held` with counts per tier
    blocks: dict[EngineHash, int | Held] = field(default_factory=dict)
    #: parent engine hash -> BlockStored events waiting for it
    orphans: dict[EngineHash, list[BlockStored]] = field(default_factory=dict)
    orphan_blocks: int = 0
    #: removals of blocks that sit in a pending orphan: applied when it is linked
    orphan_removed: dict[EngineHash, int] = field(default_factory=dict)
    #: events were lost for good (orphans dropped, undecodable payload, bad event)
    lost: bool = False
    #: distinct blocks held in the GPU tier (vLLM's own cache: <= its num_gpu_blocks)
    gpu_blocks: int = 0

    @property
    def needs_resync(self) -> bool:
        """True while orphans wait for a parent or events were lost: the router should
        replay the pod's recent batches or clear and re-learn it."""
        return self.lost or bool(self.orphans)

    def key_of(self, engine_hash: EngineHash) -> int | None:
        """Our key for a block the pod holds (None when it holds no such block)."""
        v = self.blocks.get(engine_hash)
        return None if v is None else _key(v)

    def copies(self, engine_hash: EngineHash) -> dict[str, int]:
        """Stored copies of a block per tier ({} when not held)."""
        v = self.blocks.get(engine_hash)
        if v is None:
            return {}
        return {FAST_TIER: 1} if type(v) is int else dict(v.counts)  # type: ignore[union-attr]
