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
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import zmq.asyncio

from router.events.feed import Batch, Item, PodFeed, Reconnect, ReplayDone
from router.events.guard import BatchRejected, PodFacts, precheck
from router.events.ratelimit import limited
from router.events.replay import ReplayError, contiguous_tail, fetch_replay, is_complete
from router.events.settings import EventsSettings
from router.events.stats import EventStats
from scoring.events.apply import IndexOps

log = logging.getLogger(__name__)

#: at most this many consecutive batches of one pod per turn of the writer, applied in
#: one index write (one Redis round trip); a turn also ends after ``time_slice_s`` of
#: preparing.  64 x a batch of a few blocks stays a small pipeline.
MAX_GROUP = 64


class EventWriter:
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

    # -- clearing ------------------------------------------------------------------------

    async def _clear(self, pod: str, reason: str, feed: PodFeed | None) -> bool:
        self.stats.pod(pod).resyncs[reason] += 1
        try:
            remove_pod = getattr(self.sink, "remove_pod", None)
            if reason == "removed" and remove_pod is not None:
                await remove_pod(pod)
            else:
                await self.sink.clear_pod(pod)
        except Exception as exc:
            limited(
                log, f"clear:{pod}", "KV events: %s: clearing failed (%s); will retry", pod, exc
            )
            if feed is not None:
                feed.dirty = True
            return False
        if feed is not None:
            feed.dirty = False
        limited(
            log,
            f"cleared:{pod}:{reason}",
            "KV events: %s: cleared (%s)",
            pod,
            reason,
            level=logging.INFO,
        )
        return True

    async def _clear_departed(self, pod: str, reason: str) -> None:
        await self._clear(pod, reason, None)

    async def _resync(self, feed: PodFeed, reason: str) -> None:
        feed.expected = None
        await self._clear(feed.name, reason, feed)

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

    async def _apply(self, feed: PodFeed, b: Batch) -> None:
        """Apply ``b`` and, with a sink that can prepare batches
        (``prepare_checked``), the pod's next consecutive batches already queued, in
        one index write: up to :data:`MAX_GROUP` batches or ``time_slice_s`` of
        preparing, whichever comes first (see the module docstring)."""
        if getattr(self.sink, "prepare_checked", None) is None:
            await self._apply_one(feed, b)
            return
        group: list[tuple[Batch, Any, Any]] = []
        end = time.perf_counter() + self.settings.time_slice_s
        while True:
            failure = self._prepare(feed, b, group)
            if failure is not None:
                await self._flush(feed, group)
                await self._failed(feed, b, *failure)
                return
            if (
                len(group) >= MAX_GROUP
                or time.perf_counter() >= end
                or self._lost_events(feed.name)
            ):
                break
            nxt = self._next_consecutive(feed)
            if nxt is None:
                break
            b = nxt
        await self._flush(feed, group)

    def _next_consecutive(self, feed: PodFeed) -> Batch | None:
        """The pod's next queued item when it is the batch ``expected`` and nothing
        else is due first (a drop to resync, a dirty index, a replay); taken."""
        if feed.closed or feed.replay is not None or feed.drop_seq is not None or feed.dirty:
            return None
        if not feed.pending or feed.expected is None:
            return None
        item = feed.pending[0]
        if type(item) is not Batch or item.seq != feed.expected:
            return None
        feed.take()
        return item

    def _prepare(
        self, feed: PodFeed, b: Batch, group: list[tuple[Batch, Any, Any]]
    ) -> tuple[str, Exception] | None:
        """Decode, check and prepare ``b`` (no yield); appended to ``group``, or why not
        ("decode", "rejected" or "apply", with the exception)."""
        st = self.stats.pod(feed.name)
        feed.expected = b.seq + 1
        st.last_seq = b.seq
        try:
            batch = self.sink.decode(b.payload)
        except Exception as exc:
            return "decode", exc
        facts = self.facts_of(feed.name) if self.facts_of is not None else None
        try:
            precheck(batch, facts)
            ops = self.sink.prepare_checked(feed.name, b.model, batch, facts)
        except BatchRejected as exc:
            return "rejected", exc
        except Exception as exc:
            return "apply", exc
        group.append((b, batch, ops))
        return None

    async def _flush(self, feed: PodFeed, group: list[tuple[Batch, Any, Any]]) -> None:
        """One index write for the prepared ``group``, then the bookkeeping of each."""
        if not group:
            return
        name = feed.name
        st = self.stats.pod(name)
        merged = IndexOps()
        for _, _, ops in group:
            merged.extend(ops)
        try:
            await self.sink.write(merged)
        except Exception as exc:
            st.apply_errors += 1
            limited(
                log,
                f"apply:{name}",
                "KV events: %s: applying batches %d..%d failed (%s); resync",
                name,
                group[0][0].seq,
                group[-1][0].seq,
                exc,
            )
            feed.dirty = True
            return
        now = time.time()
        for b, batch, ops in group:
            self.sink.applied(name, batch, ops)
            st.batches += 1
            st.events += len(batch.events)
            if b.replayed:
                st.replayed_batches += 1
        st.lag_s = max(0.0, now - float(group[-1][1].ts))
        st.queued = len(feed.pending)
        await self._after_apply(feed, group[-1][0].seq)

    async def _failed(self, feed: PodFeed, b: Batch, kind: str, exc: Exception) -> None:
        name = feed.name
        st = self.stats.pod(name)
        if kind == "decode":
            st.decode_errors += 1
            limited(
                log,
                f"decode:{name}",
                "KV events: %s: batch %d does not decode (%s); resync",
                name,
                b.seq,
                exc,
            )
            await self._clear(name, "decode_error", feed)
            self._fault(feed, b.seq)
        elif kind == "rejected":
            assert isinstance(exc, BatchRejected)
            st.rejected[exc.reason] += 1
            limited(
                log,
                f"reject:{name}:{exc.reason}",
                "KV events: %s: batch %d rejected (%s: %s); resync",
                name,
                b.seq,
                exc.reason,
                exc,
            )
            await self._clear(name, "rejected", feed)
            self._fault(feed, b.seq)
        else:
            st.apply_errors += 1
            limited(
                log,
                f"apply:{name}",
                "KV events: %s: applying batch %d failed (%s); resync",
                name,
                b.seq,
                exc,
            )
            feed.dirty = True

    async def _after_apply(self, feed: PodFeed, seq: int) -> None:
        name = feed.name
        if self._lost_events(name):
            last = getattr(getattr(self.sink, "stats", None), "last_error", "")
            limited(
                log,
                f"lost:{name}",
                "KV events: %s: events were skipped in batch %d (%s); resync",
                name,
                seq,
                last,
            )
            await self._clear(name, "lost_events", feed)
            self._fault(feed, seq)

    async def _apply_one(self, feed: PodFeed, b: Batch) -> None:
        """One batch through a sink's own ``apply`` (a sink that cannot prepare)."""
        st = self.stats.pod(feed.name)
        feed.expected = b.seq + 1
        st.last_seq = b.seq
        name = feed.name
        try:
            batch = self.sink.decode(b.payload)
        except Exception as exc:
            await self._failed(feed, b, "decode", exc)
            return
        facts = self.facts_of(name) if self.facts_of is not None else None
        checked = getattr(self.sink, "apply_checked", None)
        try:
            precheck(batch, facts)
            if checked is not None:
                n = await checked(name, b.model, batch, facts)
            else:
                n = await self.sink.apply(name, b.model, batch)
        except BatchRejected as exc:
            await self._failed(feed, b, "rejected", exc)
            return
        except Exception as exc:
            await self._failed(feed, b, "apply", exc)
            return
        st.batches += 1
        st.events += n
        if b.replayed:
            st.replayed_batches += 1
        st.lag_s = max(0.0, time.time() - float(batch.ts))
        await self._after_apply(feed, b.seq)

    def _lost_events(self, pod: str) -> bool:
        fn = getattr(self.sink, "lost_events", None)
        return bool(fn(pod)) if fn is not None else False

    def _fault(self, feed: PodFeed, seq: int) -> None:
        """One more fault of the pod; past its budget, quarantine it."""
        if not feed.faults.hit(time.monotonic()):
            return
        st = self.stats.pod(feed.name)
        st.quarantines += 1
        s = self.settings
        log.warning(
            "KV events: %s: more than %d faulty batches in %g s (undecodable, rejected or "
            "partly skipped): its events are dropped until the window ends, then it is "
            "resynced",
            feed.name,
            s.fault_budget,
            s.fault_window_s,
        )
        st.rejected["quarantined"] += feed.drop_pending()
        st.queued = len(feed.pending)
        if feed.replay is not None:
            feed.replay.cancel()
            feed.replay = None
        feed.drop_seq = None
        feed.note_drop(seq, "quarantine")
