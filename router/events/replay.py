"""Fetching missed batches from a vLLM publisher's replay socket.

vLLM's ``ZmqEventPublisher`` binds a ROUTER socket on ``replay_endpoint`` and keeps
the last ``buffer_steps`` (10,000) batches.  Protocol, from a DEALER:

* request: ``[b"", start_seq]`` (8-byte big-endian);
* reply: one message per buffered batch with ``seq >= start_seq``, then an end
  marker whose seq is ``-1`` (signed 8-byte big-endian) with an empty payload.

vLLM sends replies as ``[b"", seq, payload]`` (no topic, see
``vllm/distributed/kv_events.py::_service_replay``); a ``[b"", topic, seq, payload]``
framing is accepted too.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import zmq
import zmq.asyncio

END_SEQ = -1


class ReplayError(RuntimeError):
    """The replay endpoint did not answer, or answered with bad framing."""


@dataclass(frozen=True, slots=True)
class ReplayedBatch:
    seq: int
    payload: bytes


def _parse_reply(frames: list[bytes], endpoint: str) -> tuple[int, bytes]:
    if len(frames) == 3 and frames[0] == b"":
        seq_b, payload = frames[1], frames[2]
    elif len(frames) == 4 and frames[0] == b"":
        seq_b, payload = frames[2], frames[3]
    else:
        raise ReplayError(f"replay reply from {endpoint} has {len(frames)} frames, expected 3")
    if len(seq_b) != 8:
        raise ReplayError(f"replay reply from {endpoint}: seq frame is {len(seq_b)} bytes")
    return int.from_bytes(seq_b, "big", signed=True), payload


async def fetch_replay(
    ctx: zmq.asyncio.Context,
    endpoint: str,
    start_seq: int,
    *,
    stop_seq: int | None = None,
    timeout_s: float = 2.0,
) -> list[ReplayedBatch]:
    """Batches with ``start_seq <= seq`` (and ``seq < stop_seq`` when given), in order.

    Raises :class:`ReplayError` when a frame does not arrive within ``timeout_s``.
    Stops reading at the end marker, or as soon as a batch reaches ``stop_seq``.
    """
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        await sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        out: list[ReplayedBatch] = []
        while True:
            try:
                frames = await asyncio.wait_for(sock.recv_multipart(), timeout_s)
            except asyncio.TimeoutError:
                raise ReplayError(
                    f"replay endpoint {endpoint} sent nothing for {timeout_s:g}s"
                ) from None
            seq, payload = _parse_reply(frames, endpoint)
            if seq == END_SEQ:
                return out
            if seq < start_seq:
                continue
            if stop_seq is not None and seq >= stop_seq:
                return out
            out.append(ReplayedBatch(seq, payload))
    finally:
        sock.close(linger=0)
