"""KV events in vLLM's wire format, and the ZMQ publisher that sends them.

Wire format (``vllm/distributed/kv_events.py``, vLLM 0.32):

* ZMQ PUB multipart ``[topic, seq, payload]``; ``seq`` is an 8-byte big-endian
  counter starting at 0 per publisher (engine process).
* ``payload = msgpack([ts, [event, ...], data_parallel_rank])``.
* ``encoding="map"`` (vLLM 0.32): each event is a map ``{"type": "BlockStored", ...}``
  whose fields that equal their default are omitted (``extra_keys``, ``group_idx``
  and later fields have defaults; the first seven fields are always present).
  ``encoding="array"`` (older vLLM): each event is a positional array, tag first,
  every field present, in the order of the structs below.
* Replay: a ROUTER socket; a DEALER sends ``[b"", start_seq (8 bytes big-endian)]``
  and receives ``[b"", topic, seq, payload]`` for every buffered batch with
  ``seq >= start_seq`` (the last ``replay_buffer`` batches), then the end frame
  ``[b"", b"", (-1 as 8-byte signed big-endian), b""]``.

The PUB socket binds when the endpoint contains ``*`` or ``::`` or is ipc:// /
inproc:// (vLLM's rule) — and also when its TCP port is 0, which cannot be dialled —
otherwise it connects out to a subscriber's bound SUB socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections import deque
from typing import Any

import msgspec
import zmq
import zmq.asyncio

log = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)

Hash = int | bytes


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the map-encoded events (vLLM 0.32)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[Hash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class ArrayBlockStored(BlockStored, array_like=True, tag="BlockStored"):
    """Positional encoding (older vLLM)."""


class ArrayBlockRemoved(BlockRemoved, array_like=True, tag="BlockRemoved"):
    pass


class ArrayAllBlocksCleared(AllBlocksCleared, array_like=True, tag="AllBlocksCleared"):
    pass


class EventFactory:
    """Builds events for one encoding ("map" or "array")."""

    def __init__(self, encoding: str) -> None:
        if encoding not in ("map", "array"):
            raise ValueError(f"encoding must be 'map' or 'array', got {encoding!r}")
        array = encoding == "array"
        self._stored = ArrayBlockStored if array else BlockStored
        self._removed = ArrayBlockRemoved if array else BlockRemoved
        self._cleared = ArrayAllBlocksCleared if array else AllBlocksCleared

    def stored(
        self,
        block_hashes: list[Hash],
        parent: Hash | None,
        token_ids: list[int],
        block_size: int,
        *,
        lora_id: int | None,
        lora_name: str | None,
        extra_keys: list[tuple[Any, ...] | None],
    ) -> KVCacheEvent:
        return self._stored(
            block_hashes=block_hashes,
            parent_block_hash=parent,
            token_ids=token_ids,
            block_size=block_size,
            lora_id=lora_id,
            medium=MEDIUM_GPU,
            lora_name=lora_name,
            extra_keys=extra_keys or None,
            group_idx=0,
            kv_cache_spec_kind="full_attention",  # as a real vLLM 0.32 engine sends
        )

    def removed(self, block_hash: Hash) -> KVCacheEvent:
        return self._removed(block_hashes=[block_hash], medium=MEDIUM_GPU, group_idx=0)

    def cleared(self) -> KVCacheEvent:
        return self._cleared()


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule (wildcard, IPv6 any, ipc, inproc), plus TCP port 0."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith(("ipc://", "inproc://"))
        or endpoint.rsplit(":", 1)[-1] == "0"
    )


def _tcp_address(last_endpoint: str) -> tuple[socket.AddressFamily, str, int] | None:
    """(family, host, port) of a bound ``tcp://`` endpoint; None for other transports."""
    if not last_endpoint.startswith("tcp://"):
        return None
    host, _, port = last_endpoint[len("tcp://") :].rpartition(":")
    if host.startswith("["):
        return socket.AF_INET6, host.strip("[]"), int(port)
    return socket.AF_INET, host, int(port)


def _port_is_free(family: socket.AddressFamily, host: str, port: int) -> bool:
    """Whether ``host:port`` can be bound again (ZMQ binds with SO_REUSEADDR too)."""
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
        return True


async def wait_ports_released(last_endpoints: list[str], timeout_s: float = 10.0) -> bool:
    """Wait until the TCP listeners of closed ZMQ sockets are gone.

    ``zmq_close`` only asks ZMQ's I/O thread to close the listener, so right after it
    returns the port may still be taken; this polls until each port can be bound again.
    Returns False (and logs) when ``timeout_s`` passes first, e.g. because another
    process took the port meanwhile.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    for endpoint in last_endpoints:
        address = _tcp_address(endpoint)
        if address is None:
            continue
        while not _port_is_free(*address):
            if loop.time() > deadline:
                log.warning("port of %s is still taken %g s after close", endpoint, timeout_s)
                return False
            await asyncio.sleep(0.005)
    return True


def _dialable(last_endpoint: str) -> str:
    """A bound endpoint as a peer on this host dials it (0.0.0.0 -> 127.0.0.1)."""
    return last_endpoint.replace("tcp://0.0.0.0:", "tcp://127.0.0.1:")


class KVEventPublisher:
    """PUB socket + replay ROUTER for one simulated engine.

    :meth:`publish` runs in the event loop thread: it encodes the batch, assigns the
    next seq, sends without blocking (a full queue drops the batch, like a PUB at its
    high-water mark; counted in :attr:`dropped`) and keeps it for replay.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str,
        *,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        data_parallel_rank: int = 0,
    ) -> None:
        self._endpoint_setting = endpoint
        self._replay_setting = replay_endpoint
        self._topic = topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._hwm = hwm
        self._dp_rank = data_parallel_rank
        self._encoder = msgspec.msgpack.Encoder()
        self._seq = 0
        self._pub: zmq.Socket[bytes] | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self._bound: list[str] = []  # LAST_ENDPOINTs of the bound sockets
        #: concrete endpoints after :meth:`start` (None when not bound)
        self.endpoint: str | None = None
        self.replay_endpoint: str | None = None
        self.published = 0
        self.dropped = 0
        self.replays_served = 0
        self.bad_replay_requests = 0
        self.replay_errors = 0

    @property
    def binds(self) -> bool:
        return is_bind_endpoint(self._endpoint_setting)

    @property
    def next_seq(self) -> int:
        return self._seq

    async def start(self) -> None:
        pub: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        pub.set_hwm(self._hwm)
        pub.setsockopt(zmq.LINGER, 0)
        if self.binds:
            try:
                pub.bind(self._endpoint_setting)
            except zmq.ZMQError:
                pub.close(linger=0)
                raise
            self._bound.append(pub.getsockopt_string(zmq.LAST_ENDPOINT))
            self.endpoint = _dialable(self._bound[-1])
        else:
            pub.connect(self._endpoint_setting)
        self._pub = pub
        if self._replay_setting is not None:
            replay = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            try:
                replay.bind(self._replay_setting)
            except zmq.ZMQError:
                replay.close(linger=0)
                await self.stop()
                raise
            self._bound.append(replay.getsockopt_string(zmq.LAST_ENDPOINT))
            self.replay_endpoint = _dialable(self._bound[-1])
            self._replay = replay
            self._replay_task = asyncio.create_task(self._serve_replay())

    async def stop(self) -> None:
        """Close both sockets; returns once their TCP ports can be bound again."""
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
            self._replay_task = None
        if self._replay is not None:
            self._replay.close(linger=0)
            self._replay = None
        if self._pub is not None:
            self._pub.close(linger=0)
            self._pub = None
        bound, self._bound = self._bound, []
        await wait_ports_released(bound)

    def publish(self, events: list[KVCacheEvent]) -> int:
        """Send one batch; returns its seq."""
        if self._pub is None:
            raise RuntimeError("publisher is not started")
        seq = self._seq
        self._seq += 1
        payload = self._encoder.encode(
            EventBatch(ts=time.time(), events=events, data_parallel_rank=self._dp_rank)
        )
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
            self.published += 1
        except zmq.Again:
            self.dropped += 1
        return seq

    async def _serve_replay(self) -> None:
        assert self._replay is not None
        sock = self._replay
        while True:
            frames = await sock.recv_multipart()
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                # [identity, b"", start_seq(8)] expected; answer nothing, like vLLM
                self.bad_replay_requests += 1
                log.warning(
                    "invalid replay request: %d frames %r (expected [b'', 8-byte start seq])",
                    len(frames) - 1,
                    [len(f) for f in frames[1:]],
                )
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            try:
                for seq, payload in list(self._buffer):
                    if seq >= start_seq:
                        await sock.send_multipart(
                            (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                        )
                await sock.send_multipart((client, b"", b"", END_SEQ, b""))
                self.replays_served += 1
            except zmq.ZMQError as exc:  # one failed replay must not stop the socket
                self.replay_errors += 1
                log.warning("replay to a subscriber failed: %s", exc)
