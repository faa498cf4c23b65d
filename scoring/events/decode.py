"""Decoding vLLM KV-event batches (``vllm/distributed/kv_events.py``).

Wire format: a ZMQ message's payload is msgpack ``[ts, [event, ...], data_parallel_rank]``
(``data_parallel_rank`` may be missing).  Each event is either

* a **map** with a ``"type"`` tag (vLLM >= 0.32): ``{"type": "BlockStored", ...}``, where
  fields equal to their default are *omitted*; or
* a **positional array** with the tag first (older vLLM):
  ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium, lora_name, extra_keys, group_idx, ...]``, trailing defaults omitted.

Field order (both forms) as in vLLM 0.32:

* ``BlockStored``: block_hashes, parent_block_hash, token_ids, block_size, lora_id,
  medium, lora_name, extra_keys (one untagged tuple or None per block: the LoRA name if
  ``lora_name`` is set, then ``(mm_identifier, offset)`` pairs, then the cache_salt
  string on block 0 of a request, then prompt-embeds digests), group_idx, and newer
  fields (kv_cache_spec_kind, ..., session_id) that we ignore.
* ``BlockRemoved``: block_hashes, medium, group_idx, ...
* ``AllBlocksCleared``: no fields.

A block hash is an ``int`` (default: the digest's last 8 bytes, big-endian) or ``bytes``
(the raw 32- or 16-byte digest with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``); both are
hashable and used as they are.  Unknown fields are ignored.  An event with an unknown
type tag is counted in :attr:`EventBatch.unknown` and skipped; an event that cannot be
decoded is described in :attr:`EventBatch.errors` and skipped; a payload that is not a
batch at all raises :class:`DecodeError`.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

EngineHash = Union[int, bytes]  # noqa: UP007  (a runtime alias msgspec must read)


class DecodeError(ValueError):
    """The payload is not a vLLM KV-event batch; the message says what is wrong."""


class KVEvent(msgspec.Struct, tag_field="type", omit_defaults=True, gc=False):
    """Base of the decoded events."""


class BlockStored(KVEvent, tag="BlockStored"):
    """Full blocks stored by the engine; ``token_ids`` holds ``block_size`` tokens per
    hash (empty for offload placeholders that only name an already known block)."""

    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(KVEvent, tag="BlockRemoved"):
    """Physical blocks freed (one copy per hash listed)."""

    block_hashes: list[EngineHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(KVEvent, tag="AllBlocksCleared"):
    """The engine dropped its whole prefix cache."""


class _BlockStoredArray(BlockStored, array_like=True, tag="BlockStored"):
    pass


class _BlockRemovedArray(BlockRemoved, array_like=True, tag="BlockRemoved"):
    pass


class _AllBlocksClearedArray(AllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
    pass


Event = Union[BlockStored, BlockRemoved, AllBlocksCleared]  # noqa: UP007
_MapEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]  # noqa: UP007
_ArrayEvent = Union[_BlockStoredArray, _BlockRemovedArray, _AllBlocksClearedArray]  # noqa: UP007
KNOWN_TYPES = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})


class EventBatch(msgspec.Struct, gc=False):
    """One decoded batch: the events we understood, plus what was skipped."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None
    #: events with a type tag we do not know (newer engines), skipped
    unknown: int = 0
    #: one message per event that could not be decoded, skipped
    errors: list[str] = []


class _MapBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_MapEvent]
    data_parallel_rank: int | None = None


class _ArrayBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_ArrayEvent]
    data_parallel_rank: int | None = None


class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_map_batch = msgspec.msgpack.Decoder(_MapBatch)
_array_batch = msgspec.msgpack.Decoder(_ArrayBatch)
_raw_batch = msgspec.msgpack.Decoder(_RawBatch)
_map_event = msgspec.msgpack.Decoder(_MapEvent)
_array_event = msgspec.msgpack.Decoder(_ArrayEvent)
_any = msgspec.msgpack.Decoder()

_MAP_FIRST = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])
_ARRAY_FIRST = frozenset([*range(0x90, 0xA0), 0xDC, 0xDD])


def _event_type(raw: msgspec.Raw) -> object:
    """The type tag of an undecodable event, or None when it has none."""
    try:
        obj = _any.decode(raw)
    except msgspec.DecodeError:
        return None
    if isinstance(obj, dict):
        return obj.get("type")
    if isinstance(obj, list) and obj:
        return obj[0]
    return None


def _decode_one(raw: msgspec.Raw, index: int, batch: EventBatch) -> None:
    first = bytes(memoryview(raw)[:1])
    code = first[0] if first else -1
    decoder = _map_event if code in _MAP_FIRST else _array_event if code in _ARRAY_FIRST else None
    if decoder is None:
        batch.errors.append(f"event {index}: not a map or an array")
        return
    try:
        batch.events.append(decoder.decode(raw))
        return
    except msgspec.ValidationError as exc:
        tag = _event_type(raw)
        if isinstance(tag, str) and tag not in KNOWN_TYPES:
            batch.unknown += 1
            return
        batch.errors.append(f"event {index} ({tag!r}): {exc}")
    except msgspec.DecodeError as exc:
        batch.errors.append(f"event {index}: {exc}")


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one vLLM KV-event payload (either event encoding, even mixed).

    Raises :class:`DecodeError` when ``payload`` is not ``[ts, [events...], rank?]``.
    """
    for decoder in (_map_batch, _array_batch):
        try:
            b = decoder.decode(payload)
        except (msgspec.ValidationError, msgspec.DecodeError):
            continue
        return EventBatch(b.ts, list(b.events), b.data_parallel_rank)
    try:
        raw = _raw_batch.decode(payload)
    except msgspec.ValidationError as exc:  # (a subclass of msgspec.DecodeError)
        raise DecodeError(
            f"KV-event payload is not a batch [ts, [events], data_parallel_rank]: {exc}"
        ) from None
    except msgspec.DecodeError as exc:
        raise DecodeError(f"KV-event payload is not valid msgpack: {exc}") from None
    batch = EventBatch(raw.ts, [], raw.data_parallel_rank)
    for i, ev in enumerate(raw.events):
        _decode_one(ev, i, batch)
    return batch


_encoder = msgspec.msgpack.Encoder()


def encode_batch(
    events: list[Event], ts: float = 0.0, data_parallel_rank: int | None = None
) -> bytes:
    """Encode events as vLLM >= 0.32 does (maps with a "type" tag, defaults omitted).

    Used by tests, benchmarks and the simulated pod.
    """
    return _encoder.encode(_MapBatch(ts, events, data_parallel_rank))


def encode_batch_positional(
    events: list[Event], ts: float = 0.0, data_parallel_rank: int | None = None
) -> bytes:
    """Encode events as older vLLM did (positional arrays, tag first)."""
    arrays: list[Any] = []
    for ev in events:
        if isinstance(ev, BlockStored):
            arrays.append(_BlockStoredArray(**msgspec.structs.asdict(ev)))
        elif isinstance(ev, BlockRemoved):
            arrays.append(_BlockRemovedArray(**msgspec.structs.asdict(ev)))
        else:
            arrays.append(_AllBlocksClearedArray())
    return _encoder.encode(_ArrayBatch(ts, arrays, data_parallel_rank))
