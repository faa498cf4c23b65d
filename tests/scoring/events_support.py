"""Helpers shared by the ``test_events_*.py`` files (KV events, decoded and applied to an
in-memory index): the block size, model and tokens the tests use, the router's own keys of
a prompt, an applier with one registered pod, and a BlockStored builder.

Events are built with the project's encoder (vLLM 0.32's map encoding) or its positional
twin (older vLLM), or written out by hand with msgpack where a test needs a shape the
encoder cannot produce.
"""

from __future__ import annotations

import msgspec

from scoring.blocks import BlockHasher
from scoring.events import (
    BlockStored,
    KVEventApplier,
    encode_batch,
)
from scoring.index.memory import InMemoryIndex

BS = 16
MODEL = "m"
TOKENS = list(range(1000, 1064))  # 4 blocks of 16
MASK64 = (1 << 64) - 1
enc = msgspec.msgpack.encode


def keys_of(tokens: list[int], *, lora: str | None = None, salt: str | None = None) -> list[int]:
    """The router's own block keys for a prompt (what lookups use)."""
    return BlockHasher(BS, MODEL).keys(tokens, lora=lora, cache_salt=salt)


def gpu(n: int, index: InMemoryIndex) -> dict[str, int]:
    return dict.fromkeys(index.tiers, n)


def setup(**kwargs: object) -> tuple[KVEventApplier, InMemoryIndex]:
    applier = KVEventApplier(**kwargs)  # type: ignore[arg-type]
    applier.set_pod("p", MODEL)
    return applier, InMemoryIndex()


def feed(applier: KVEventApplier, index: InMemoryIndex, *events: object, pod: str = "p") -> None:
    applier.ingest_sync(index, pod, encode_batch(list(events)))  # type: ignore[arg-type]


def stored(hashes: list[int], parent: int | None, tokens: list[int], **kw: object) -> BlockStored:
    return BlockStored(hashes, parent, tokens, BS, None, kw.pop("medium", "GPU"), **kw)  # type: ignore[arg-type]
