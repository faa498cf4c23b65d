"""The KV-event subscriber's socket readers: receive ``[topic, seq, payload]``
messages, check their framing and sender, and queue them on their pod's
:class:`~router.events.feed.PodFeed` for the writer (see "readers" and "Who may speak
for a pod" in :mod:`router.events.subscriber`).

:class:`SocketReaders` is a part of :class:`router.events.subscriber.KVEventSubscriber`
(its base class)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import zmq
import zmq.asyncio

from router.events.feed import Batch, PodFeed
from router.events.ratelimit import limited
from router.events.settings import EventsSettings
from router.events.stats import EventStats
from router.events.topic import TopicError, parse_topic
from router.events.writer import EventWriter
from router.events.zap import SourceCheck

#: the subscriber's logger (and so its rate limiter): its lines keep their logger name
log = logging.getLogger("router.events.subscriber")


class SocketReaders:
    """The reader tasks of dial and bind mode and what they share: framing checks,
    rejections, the per-pod queues' intake and the time slice (a base of
    :class:`~router.events.subscriber.KVEventSubscriber`, which sets these
    attributes)."""

    settings: EventsSettings
    stats: EventStats
    sources: SourceCheck | None
    _feeds: dict[str, PodFeed]
    _writer: EventWriter

    def _split(self, frames: list[bytes], who: str) -> tuple[bytes, int, bytes] | None:
        """``[topic, seq, payload]`` -> parts, or None (counted) on bad framing."""
        if len(frames) != 3 or len(frames[1]) != 8:
            detail = (
                f"{len(frames)} frames, expected 3"
                if len(frames) != 3
                else f"seq frame of {len(frames[1])} bytes, expected 8"
            )
            limited(
                log, f"frame:{who}", "KV events: %s: malformed message skipped: %s", who, detail
            )
            return None
        return frames[0], int.from_bytes(frames[1], "big"), frames[2]

    def _reject(self, pod: str, reason: str, detail: str) -> None:
        self.stats.pod(pod).rejected[reason] += 1
        limited(
            log,
            f"reject:{pod}:{reason}",
            "KV events: %s: message rejected (%s): %s",
            pod,
            reason,
            detail,
        )

    def _enqueue(self, feed: PodFeed, model: str, seq: int, payload: bytes) -> None:
        st = self.stats.pod(feed.name)
        if feed.faults.quarantined(time.monotonic()):
            st.rejected["quarantined"] += 1
            feed.note_drop(seq, "quarantine")
            return
        if not feed.offer(Batch(seq, payload, model), self.settings.queue_size):
            st.dropped += 1
            if feed.note_drop(seq, "overflow"):
                limited(
                    log,
                    f"queue:{feed.name}",
                    "KV events: %s: queue full (%d), batch %d dropped, pod marked for resync",
                    feed.name,
                    self.settings.queue_size,
                    seq,
                )
            return
        st.queued = len(feed.pending)
        self._writer.schedule(feed)

    async def _pause(self, slice_end: float) -> float:
        """Yield to the loop when this task's time slice is over; the new slice's end.

        Awaiting a ready ZMQ message or a non-empty queue does not suspend, so without
        this a flood of batches would keep the loop from serving requests."""
        now = time.perf_counter()
        if now < slice_end:
            return slice_end
        await asyncio.sleep(0)
        return time.perf_counter() + self.settings.time_slice_s

    async def _recv(
        self, sock: zmq.asyncio.Socket, who: str, copy: bool = True
    ) -> list[Any] | None:
        """One message; None after a socket error (logged; the reader goes on)."""
        try:
            return await sock.recv_multipart(copy=copy)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.ETERM:
                raise asyncio.CancelledError() from exc
            limited(log, f"recv:{who}", "KV events: %s: receive failed: %s", who, exc)
            await asyncio.sleep(0.1)
            return None

    async def _dial_reader(self, feed: PodFeed, sock: zmq.asyncio.Socket) -> None:
        slice_end = 0.0
        while True:
            slice_end = await self._pause(slice_end)
            frames = await self._recv(sock, feed.name)
            if frames is None:
                continue
            parts = self._split(frames, feed.name)
            if parts is None:
                self.stats.pod(feed.name).malformed_frames += 1
                continue
            topic, seq, payload = parts
            model = feed.model
            if topic:
                with contextlib.suppress(TopicError):
                    t = parse_topic(topic)
                    if t.pod != feed.name:
                        self._reject(feed.name, "wrong_pod", f"topic names pod {t.pod[:64]!r}")
                        continue
                    if t.model:
                        model = feed.model = t.model
                        feed.topic_model = True
            self._enqueue(feed, model, seq, payload)

    async def _bind_reader(self, sock: zmq.asyncio.Socket) -> None:
        slice_end = 0.0
        sources = self.sources
        check = sources is not None
        while True:
            slice_end = await self._pause(slice_end)
            got = await self._recv(sock, "bind", copy=not check)
            if got is None:
                continue
            peer = ""
            if check:
                with contextlib.suppress(zmq.ZMQError):
                    peer = got[0].get("Peer-Address") if got else ""
                frames: list[bytes] = [f.bytes for f in got]
            else:
                frames = got
            topic_raw = frames[0] if frames else b""
            try:
                topic = parse_topic(topic_raw)
            except TopicError as exc:
                self.stats.bad_topics += 1
                limited(log, "topic", "KV events: batch skipped: %s", exc)
                continue
            feed = self._feeds.get(topic.pod)
            if feed is None:
                self.stats.unknown_pod_batches += 1
                limited(
                    log,
                    f"unknown:{topic.pod[:64]}",
                    "KV events: batch from unknown pod %r skipped",
                    topic.pod[:64],
                )
                continue
            if sources is not None and not sources.matches(feed.name, peer):
                known = sources.describe(feed.name)
                self._reject(
                    feed.name,
                    "wrong_source",
                    f"sent from {peer or '?'}, the pod's addresses: {known}",
                )
                continue
            parts = self._split(frames, topic.pod)
            if parts is None:
                self.stats.pod(topic.pod).malformed_frames += 1
                continue
            _, seq, payload = parts
            self._enqueue(feed, topic.model or feed.model, seq, payload)
