"""The index writer: one task applying every pod's batches in seq order, fairly.

It serves the pods round-robin, one turn per pod with work
(:class:`~router.events.feed.PodFeed.pending`), so a pod with 10,000 batches queued
delays another pod's next batch by one turn, not by 10,000.  A turn is one item; a
batch applied in order takes the pod's next consecutive batches already queued with
it (at most :data:`MAX_GROUP`, or ``time_slice_s`` of decoding and preparing): their
index writes go out as one write, one Redis round trip.  A writer sharing its loop
with the request path gets one round trip per loop pass or so; at one batch per round
trip it fell behind the soak's load (per-pod queues overflowed, each overflow a resync
and a replay to catch up on), grouped it keeps up, and each turn still ends with a
yield.

Sequence semantics per pod (``expected`` = last applied seq + 1):

* ``seq == expected``: apply.
* ``seq > expected``: a **gap**.  With ``replay_on_gap`` and a ``replay_endpoint``, a
  **replay task** for that pod fetches ``[expected, seq)`` while the writer goes on with
  the other pods; the pod's live batches wait in its queue (bounded) and are applied
  after the replayed ones.  A replay that covers the gap is applied; one whose buffer no
  longer reaches back (or has a hole) resyncs the pod and re-learns it from the
  consecutive tail the buffer still holds; a failed one (per-frame timeout, overall
  deadline, no replay endpoint) resyncs it.
* ``seq < expected``: the engine restarted: the pod is cleared, then the batch applied.
* The first batch of a pod with ``seq > 0`` (a late join, or after a reconnect): with
  ``replay_on_join``, a replay task fetches ``[0, seq)``.  Complete (first frame 0, no
  hole): applied.  Otherwise (the buffer starts later, a seq is missing, the replay
  failed) the pod is **resynced** like a gap ("join_gap": an index that another writer
  filled may hold entries we can no longer correct) and re-learned from the
  consecutive tail.
* Dial mode: a dropped connection resyncs the pod in order with its batches; its next
  batch is a join again.
* A batch that does not decode, that contradicts the pod (:mod:`router.events.guard`:
  "rejected") or whose events the sink had to skip (``lost_events``) consumes its seq
  and resyncs the pod; each is a **fault** (:class:`~router.events.feed.FaultWindow`).

**Resync** = forget everything the index holds for the pod (``sink.clear_pod``) and
re-learn it from the next batches.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import zmq.asyncio

from router.events.feed import Batch, Item, PodFeed, Reconnect, ReplayDone
from router.events.guard import PodFacts
from router.events.ratelimit import limited
from router.events.replay import ReplayError, contiguous_tail, fetch_replay, is_complete
from router.events.settings import EventsSettings
from router.events.stats import EventStats
from router.events.writer_batches import MAX_GROUP, BatchWriting

__all__ = ["MAX_GROUP", "EventWriter"]

log = logging.getLogger(__name__)


class EventWriter(BatchWriting):
    """Applies the pods' queued batches to ``sink`` (see the module docstring)."""

    def __init__(
        self,
        settings: EventsSettings,
        sink: Any,
        stats: EventStats,
        ctx: zmq.asyncio.Context,
        pause: Callable[[float], Awaitable[float]],
        facts_of: Callable[[str], PodFacts | None] | None = None,
    ) -> None:
        self.settings = settings
        self.sink = sink
        self.stats = stats
        self._ctx = ctx
        self._pause = pause
        self.facts_of = facts_of
        self._ready: deque[PodFeed] = deque()
        #: clears of pods that left (their feed is gone): before any pod's batch
        self._control: deque[tuple[str, str]] = deque()
        self._wake = asyncio.Event()
        self._replays: set[asyncio.Task[None]] = set()
        self.busy = False

    # -- what the readers call ---------------------------------------------------------

    def schedule(self, feed: PodFeed) -> None:
        """``feed`` has work: give it a turn (unless its replay is running)."""
        if feed.scheduled or feed.closed or feed.replay is not None or not feed.pending:
            return
        feed.scheduled = True
        self._ready.append(feed)
        self._wake.set()

    def clear_departed(self, pod: str, reason: str) -> None:
        self._control.append((pod, reason))
        self._wake.set()

    def close_feed(self, feed: PodFeed) -> None:
        feed.closed = True
        if feed.name in self.stats.pods:
            self.stats.pods[feed.name].queued = 0
        if feed.replay is not None:
            feed.replay.cancel()
            feed.replay = None

    def idle(self) -> bool:
        return not (self._ready or self._control or self._replays or self.busy)

    async def stop(self) -> None:
        for task in list(self._replays):
            task.cancel()
        for task in list(self._replays):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    # -- the loop ------------------------------------------------------------------------

    async def run(self) -> None:
        slice_end = 0.0
        while True:
            slice_end = await self._pause(slice_end)
            if self._control:
                pod, reason = self._control.popleft()
                await self._guarded(self._clear_departed(pod, reason), pod)
                continue
            if not self._ready:
                self._wake.clear()
                await self._wake.wait()
                continue
            feed = self._ready.popleft()
            feed.scheduled = False
            if feed.closed or feed.replay is not None or not feed.pending:
                continue
            item = feed.take()
            self.stats.pod(feed.name).queued = len(feed.pending)
            await self._guarded(self._item(feed, item), feed.name)
            self.schedule(feed)

    async def _guarded(self, work: Awaitable[None], pod: str) -> None:
        self.busy = True
        try:
            await work
        except asyncio.CancelledError:
            raise
        except Exception:  # never let one batch kill the writer
            log.exception("KV events: %s: unexpected error in the index writer", pod)
        finally:
            self.busy = False

    async def _item(self, feed: PodFeed, item: Item) -> None:
        if isinstance(item, Reconnect):
            stop = feed.expected
            await self._resync(feed, item.reason)
            feed.joined = False  # the next batch re-learns from the replay buffer
            if item.reason == "data_loss" and stop and self._can_join(feed):
                # the pod's stream is fine, only the index lost it: re-learn now from the
                # buffer up to where we were, not at its next batch (it may be idle)
                feed.joined = True
                self._spawn_fetch(feed, "join", 0, stop)
        elif isinstance(item, ReplayDone):
            await self._replayed(feed, item)
        else:
            await self._handle(feed, item)

    async def _clear_departed(self, pod: str, reason: str) -> None:
        await self._clear(pod, reason, None)

    # -- batches -------------------------------------------------------------------------

    async def _handle(self, feed: PodFeed, b: Batch) -> None:
        st = self.stats.pod(feed.name)
        if feed.drop_seq is not None and not b.replayed and b.seq > feed.drop_seq:
            feed.drop_seq = None
            await self._resync(feed, feed.drop_reason)
        elif feed.dirty:
            await self._resync(feed, "apply_error")
        exp = feed.expected
        endpoint = feed.spec.replay_endpoint
        if exp is None and not feed.joined:
            feed.joined = True
            if b.seq > 0 and self.settings.replay_on_join and endpoint:
                self._start_replay(feed, "join", 0, b)
                return
        if exp is not None and b.seq > exp:
            st.gaps += 1
            st.missed_batches += b.seq - exp
            limited(
                log,
                f"gap:{feed.name}",
                "KV events: %s: gap, expected seq %d, got %d",
                feed.name,
                exp,
                b.seq,
            )
            if self.settings.replay_on_gap and endpoint:
                self._start_replay(feed, "gap", exp, b)
                return
            await self._resync(feed, "gap")
        elif exp is not None and b.seq < exp:
            st.restarts += 1
            limited(
                log,
                f"restart:{feed.name}",
                "KV events: %s: seq went back from %d to %d: engine restart",
                feed.name,
                exp,
                b.seq,
            )
            await self._resync(feed, "restart")
        await self._apply(feed, b)

    def _can_join(self, feed: PodFeed) -> bool:
        return bool(self.settings.replay_on_join and feed.spec.replay_endpoint) and (
            feed.replay is None
        )

    def _start_replay(
        self, feed: PodFeed, kind: Literal["gap", "join"], start: int, b: Batch
    ) -> None:
        """Fetch ``[start, b.seq)`` in a task of its own; ``b`` waits at the front."""
        feed.put_back(b)
        self._spawn_fetch(feed, kind, start, b.seq)

    def _spawn_fetch(
        self, feed: PodFeed, kind: Literal["gap", "join"], start: int, stop: int
    ) -> None:
        task = asyncio.create_task(
            self._fetch(feed, kind, start, stop), name=f"kv-events-replay-{feed.name}"
        )
        feed.replay = task
        self._replays.add(task)
        task.add_done_callback(self._replays.discard)

    async def _fetch(
        self, feed: PodFeed, kind: Literal["gap", "join"], start: int, stop: int
    ) -> None:
        endpoint = feed.spec.replay_endpoint
        assert endpoint is not None
        s = self.settings
        try:
            batches = await fetch_replay(
                self._ctx,
                endpoint,
                start,
                stop_seq=stop,
                timeout_s=s.replay_timeout_s,
                deadline_s=s.replay_deadline_s,
                time_slice_s=s.time_slice_s,
            )
            done = ReplayDone(kind, start, stop, batches)
        except ReplayError as exc:
            done = ReplayDone(kind, start, stop, [], str(exc))
        if feed.replay is not asyncio.current_task():
            return  # the feed was closed or quarantined meanwhile
        feed.replay = None
        feed.pending.appendleft(done)
        self.schedule(feed)

    async def _replayed(self, feed: PodFeed, done: ReplayDone) -> None:
        st = self.stats.pod(feed.name)
        name, start, stop = feed.name, done.start, done.stop
        if done.error is not None:
            st.replay_failures += 1
            limited(
                log,
                f"replay:{name}",
                "KV events: %s: %s replay failed: %s; resync",
                name,
                done.kind,
                done.error,
            )
            await self._resync(feed, "gap" if done.kind == "gap" else "join_gap")
            return
        got = done.batches
        if is_complete(got, start, stop):
            st.replays += 1
            self._prepend(feed, got)
            if done.kind == "join":
                log.info(
                    "KV events: %s: joined at seq %d, replayed %d batches", name, stop, len(got)
                )
            return
        tail = contiguous_tail(got, stop)
        if done.kind == "gap":
            st.replay_failures += 1
        else:
            st.replays += 1
        limited(
            log,
            f"replay-hole:{name}",
            "KV events: %s: %s replay of seq %d..%d is incomplete (first held: %s, %d "
            "of %d batches); resync from the %d consecutive ones before %d",
            name,
            done.kind,
            start,
            stop - 1,
            got[0].seq if got else None,
            len(got),
            stop - start,
            len(tail),
            stop,
        )
        # clear, then re-learn from the buffer: as if we had joined at the tail's start
        await self._resync(feed, "gap" if done.kind == "gap" else "join_gap")
        self._prepend(feed, tail)

    def _prepend(self, feed: PodFeed, batches: list[Any]) -> None:
        model = feed.model
        feed.pending.extendleft(
            Batch(rb.seq, rb.payload, model, replayed=True) for rb in reversed(batches)
        )
