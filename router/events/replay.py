"""Fetching missed batches from a vLLM publisher's replay socket.

vLLM's ``ZmqEventPublisher`` binds a ROUTER socket on ``replay_endpoint`` and keeps
the last ``buffer_steps`` (10,000) batches.  Protocol, from a DEALER:

* request: ``[b"", start_seq]`` (8-byte big-endian);
* reply: one message per buffered batch with ``seq >= start_seq``, then an end
  marker whose seq is ``-1`` (signed 8-byte big-endian) with an empty payload.

vLLM sends replies as ``[b"", seq, payload]`` (``vllm/distributed/kv_events.py``,
``_service_replay``); a ``[b"", topic, seq, payload]`` framing (vLLM 0.32 as captured,
and ``router.sim``) is accepted too.

**Why long replays lost frames.**  The publisher sends the whole reply in one tight
loop of non-blocking sends on its ROUTER, whose per-peer pipe holds ``SNDHWM`` (ZMQ's
default: 1,000) messages; a ROUTER *drops* what does not fit, silently, end marker
included.  The pipe drains only as fast as ZMQ's I/O thread writes to TCP and the
subscriber reads, so a reply longer than about 1,000 batches came back with holes
(and sometimes without its end marker: then the client waited for a frame that never
came).  The client cannot change the publisher's HWM; it does two things instead:

* its DEALER has no receive high-water mark (``RCVHWM=0``: the I/O thread takes all
  that arrives, bounded by the publisher's buffer) and drains every ready frame per
  wake-up, so the publisher's pipe empties as fast as TCP allows;
* it **resumes**: a seq that jumps inside one reply means frames were dropped in
  transit, so it asks again, on a fresh socket, from the first seq it lacks; each
  round delivers at least what fits in the pipe, so a 10,000-batch buffer takes a few
  rounds at worst.  A round that ends silently (its end marker dropped) after having
  delivered frames is resumed the same way.

A *first* frame later than asked for is not a transit loss (a new peer's pipe starts
empty) but the buffer's horizon: the batches before it are gone from the publisher.
:func:`fetch_replay` returns what the buffer holds and the caller decides; a horizon
reached in a later round leaves a hole in the result, which :func:`is_complete` and
:func:`contiguous_tail` let the caller see.

Deadlines: ``timeout_s`` bounds the wait for each frame, ``deadline_s`` the whole
replay (a socket trickling one frame just under ``timeout_s`` apart cannot hold a
replay open for longer).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import zmq
import zmq.asyncio

END_SEQ = -1

#: at most this many rounds of one replay (each round makes progress or ends it)
MAX_ROUNDS = 64


class ReplayError(RuntimeError):
    """The replay endpoint did not answer in time, or answered with bad framing."""


@dataclass(frozen=True, slots=True)
class ReplayedBatch:
    seq: int
    payload: bytes


def _parse_reply(frames: Sequence[bytes], endpoint: str) -> tuple[int, bytes]:
    if len(frames) == 3 and frames[0] == b"":
        seq_b, payload = frames[1], frames[2]
    elif len(frames) == 4 and frames[0] == b"":
        seq_b, payload = frames[2], frames[3]
    else:
        raise ReplayError(f"replay reply from {endpoint} has {len(frames)} frames, expected 3")
    if len(seq_b) != 8:
        raise ReplayError(f"replay reply from {endpoint}: seq frame is {len(seq_b)} bytes")
    return int.from_bytes(seq_b, "big", signed=True), payload


def is_complete(batches: Sequence[ReplayedBatch], start: int, stop: int) -> bool:
    """Whether ``batches`` are exactly the seqs ``start .. stop - 1``."""
    return len(batches) == stop - start and all(b.seq == start + i for i, b in enumerate(batches))


def contiguous_tail(batches: Sequence[ReplayedBatch], stop: int) -> list[ReplayedBatch]:
    """The longest run of consecutive seqs at the end of ``batches`` that ends at
    ``stop - 1`` ([] when the last batch is not ``stop - 1``)."""
    if not batches or batches[-1].seq != stop - 1:
        return []
    i = len(batches) - 1
    while i > 0 and batches[i - 1].seq == batches[i].seq - 1:
        i -= 1
    return list(batches[i:])


class _Round:
    """One request on one fresh DEALER: collects consecutive frames from ``want``."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.connect(endpoint)
        #: the same socket, synchronous: drains ready frames without a Future each
        self.sync: zmq.Socket[bytes] = zmq.Socket.shadow(self.sock.underlying)

    def close(self) -> None:
        self.sock.close(linger=0)


async def fetch_replay(
    ctx: zmq.asyncio.Context,
    endpoint: str,
    start_seq: int,
    *,
    stop_seq: int | None = None,
    timeout_s: float = 2.0,
    deadline_s: float = 10.0,
    time_slice_s: float = 0.002,
) -> list[ReplayedBatch]:
    """Batches with ``start_seq <= seq`` (and ``seq < stop_seq`` when given), in order.

    Consecutive from the first seq the publisher still holds, except where the buffer's
    horizon passed between two rounds (see the module docstring).  Ends at the end
    marker, or as soon as ``stop_seq - 1`` arrived.  Raises :class:`ReplayError` when a
    round delivers nothing within ``timeout_s``, when the replay takes longer than
    ``deadline_s``, or on bad framing.  Yields the loop every ``time_slice_s``.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + deadline_s
    out: list[ReplayedBatch] = []
    want = start_seq
    for _ in range(MAX_ROUNDS):
        done, want = await _round(
            ctx, endpoint, want, stop_seq, out, timeout_s, deadline, time_slice_s
        )
        if done:
            return out
    raise ReplayError(f"replay from {endpoint} did not complete in {MAX_ROUNDS} rounds")


async def _round(
    ctx: zmq.asyncio.Context,
    endpoint: str,
    want: int,
    stop: int | None,
    out: list[ReplayedBatch],
    timeout_s: float,
    deadline: float,
    time_slice_s: float,
) -> tuple[bool, int]:
    """Ask from ``want``; append consecutive frames to ``out``.  -> (finished, next want).
    Not finished: frames were lost in transit (or the end marker was), ask again."""
    loop = asyncio.get_running_loop()
    r = _Round(ctx, endpoint)
    first = True
    got = 0
    try:
        await r.sock.send_multipart([b"", want.to_bytes(8, "big")])
        slice_end = time.perf_counter() + time_slice_s
        while True:
            left = deadline - loop.time()
            if left <= 0:
                raise ReplayError(
                    f"replay from {endpoint} did not complete within its deadline "
                    f"({len(out)} batches received)"
                )
            if not await r.sock.poll(int(min(timeout_s, left) * 1000) + 1):
                if loop.time() >= deadline:
                    continue  # reported above
                if got:
                    return False, want  # the end marker was dropped: ask for the rest
                raise ReplayError(f"replay endpoint {endpoint} sent nothing for {timeout_s:g}s")
            while True:  # drain what is ready: one wake-up per burst, not per frame
                try:
                    frames = r.sync.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                seq, payload = _parse_reply(frames, endpoint)
                if seq == END_SEQ:
                    return True, want
                if seq < want:
                    continue
                if stop is not None and seq >= stop:
                    return True, want
                if seq > want and not first:
                    return False, want  # dropped in transit: resume from the hole
                first = False
                out.append(ReplayedBatch(seq, payload))
                got += 1
                want = seq + 1
                if stop is not None and want >= stop:
                    return True, want
                if time.perf_counter() >= slice_end:
                    await asyncio.sleep(0)
                    slice_end = time.perf_counter() + time_slice_s
    finally:
        r.close()
