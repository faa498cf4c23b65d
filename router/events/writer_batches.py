"""How :class:`~router.events.writer.EventWriter` writes a pod's batches to the sink:
a group of consecutive batches prepared and sent as one index write (:data:`MAX_GROUP`),
the sink's own ``apply`` for a sink that cannot prepare, the faults (undecodable,
rejected, partly skipped) and the clears of a resync."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from router.events.feed import Batch, PodFeed
from router.events.guard import BatchRejected, PodFacts, precheck
from router.events.ratelimit import limited
from router.events.settings import EventsSettings
from router.events.stats import EventStats
from scoring.events.apply import IndexOps

log = logging.getLogger(__name__)

#: at most this many consecutive batches of one pod per turn of the writer, applied in
#: one index write (one Redis round trip); a turn also ends after ``time_slice_s`` of
#: preparing.  64 x a batch of a few blocks stays a small pipeline.
MAX_GROUP = 64


class BatchWriting:
    """The batch-writing half of :class:`~router.events.writer.EventWriter` (which sets
    these attributes)."""

    settings: EventsSettings
    sink: Any
    stats: EventStats
    facts_of: Callable[[str], PodFacts | None] | None

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

    async def _resync(self, feed: PodFeed, reason: str) -> None:
        feed.expected = None
        await self._clear(feed.name, reason, feed)

    # -- batches -------------------------------------------------------------------------

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
