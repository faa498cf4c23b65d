"""The KV-event subscriber: ZMQ sockets -> bounded queue -> index writer.

Two tasks kinds share one asyncio loop with the request path:

* **readers** (one per pod SUB socket in dial mode, one bound SUB socket in bind mode)
  only receive ``[topic, seq, payload]`` messages, check their framing, and put them on
  a bounded queue — a full queue drops the batch (counted) and marks the pod for
  resync, so a slow index never stalls the sockets or the loop;
* **one writer** takes batches in order, tracks ``seq`` per pod, decodes the payload and
  applies it to the index through an :class:`EventSink`.

Sequence semantics per pod (``expected`` = last applied seq + 1):

* ``seq == expected``: apply.
* ``seq > expected``: a **gap** (the publisher's high-water mark dropped batches, or
  a network hiccup).  With ``replay_on_gap`` and a pod ``replay_endpoint``, the missed
  batches ``[expected, seq)`` are fetched from the pod's replay socket and applied
  first.  If its buffer no longer reaches back to ``expected``, the pod is **resynced**
  and re-learned from the batches the buffer still holds (as if we had joined at the
  oldest one); if the replay fails (or there is no replay endpoint), it is resynced.
* ``seq < expected``: the engine restarted (vLLM numbers batches from 0 per engine
  process): the pod is cleared, then the batch applied.
* A pod removed from the registry is cleared.
* Dial mode: when the connection to a pod's publisher drops (engine restart, network),
  the pod is resynced at that point of the stream; the next batch re-learns it from the
  replay buffer (join replay below).  Without this, a restarted engine whose first
  batches we missed would look like a gap, not a restart, and stale blocks would stay.
* The first batch of a pod with ``seq > 0`` (the router joined late, or restarted):
  with ``replay_on_join`` the pod's replay buffer is applied first, so the blocks its
  engine stored recently are known at once.
* The sink had to skip some events of a batch (``lost_events``): resync.

**Resync** = forget everything the index holds for the pod (``sink.clear_pod``) and
re-learn it from the next batches.  Blocks the engine stored before the resync and
still holds are unknown until it stores them again; BlockStored events whose parent
was lost this way show up in the applier's orphan counters
(``scoring.events`` stats), and BlockRemoved events for them are ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import zmq
import zmq.asyncio
from prometheus_client.registry import CollectorRegistry
from zmq.utils.monitor import parse_monitor_message

from router.events.replay import ReplayError, fetch_replay
from router.events.settings import EventsSettings
from router.events.stats import EventStats, register_event_stats
from router.events.topic import TopicError, parse_topic
from router.fleet.pods import PodRegistry, PodSpec

log = logging.getLogger(__name__)

#: repeated warnings of one kind about one pod are logged at most this often
WARN_EVERY_S = 10.0


class DecodedBatch(Protocol):
    """What the sink's decoder returns: the engine timestamp and the events."""

    @property
    def ts(self) -> float: ...

    @property
    def events(self) -> Any: ...


class EventSink(Protocol):
    """Decodes vLLM batches and applies them to an index (``scoring.events.IndexSink``).

    Optional extensions, used when the sink has them (:class:`router.events.IndexSink`
    does): ``async remove_pod(pod)`` (the pod left: forget it entirely; else
    ``clear_pod``), ``lost_events(pod) -> bool`` (some events had to be skipped:
    resync), ``stats`` (an object with ``as_dict()``, or a callable returning a
    dict: exported as ``kvroute_event_applier_*``), ``extra_stats() -> dict`` (more
    such counters) and ``gauges() -> dict`` (exported as ``kvroute_event_*`` gauges).
    """

    def decode(self, payload: bytes) -> DecodedBatch:
        """Raise ``ValueError`` on a payload that is not a vLLM event batch."""
        ...

    async def apply(self, pod: str, model: str, batch: Any) -> int:
        """Apply ``batch`` as published by ``pod`` serving ``model``; return #events."""
        ...

    async def clear_pod(self, pod: str) -> None:
        """Forget the pod's entries (index and per-pod engine-hash map)."""
        ...


@dataclass(slots=True)
class _Batch:
    pod: str
    gen: int
    model: str
    seq: int
    payload: bytes


@dataclass(slots=True)
class _Clear:
    pod: str
    reason: str


@dataclass(slots=True)
class _Reconnect:
    """Dial mode: the pod's PUB connection dropped (queued in order with its batches)."""

    pod: str
    gen: int


@dataclass
class _Feed:
    """Per-pod subscription state."""

    name: str
    spec: PodSpec
    gen: int
    model: str
    #: next seq we expect (None: accept any, e.g. first batch or after a resync)
    expected: int | None = None
    #: seq of the first batch dropped on overflow, not yet handled by the writer
    drop_seq: int | None = None
    #: the index may hold stale entries (a clear failed): clear before the next apply
    dirty: bool = False
    #: the first batch was seen (join replay done)
    joined: bool = False
    socket: zmq.asyncio.Socket | None = None
    reader: asyncio.Task[None] | None = None
    monitor: zmq.asyncio.Socket | None = None
    watcher: asyncio.Task[None] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _spec_model(spec: PodSpec, fallback: str) -> str:
    return spec.models[0] if spec.models else fallback


class KVEventSubscriber:
    """Subscribes to the KV events of every pod in ``registry`` and feeds ``sink``.

    Use ``await start()`` / ``await stop()`` from the loop that owns it.  In bind mode
    :attr:`bound_endpoint` is the actual endpoint (resolving a ``*`` port).
    """

    def __init__(
        self,
        settings: EventsSettings,
        registry: PodRegistry,
        sink: EventSink,
        *,
        metrics_registry: CollectorRegistry | None = None,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.settings = settings
        self.registry = registry
        self.sink = sink
        self.stats = EventStats()
        self._ctx = context or zmq.asyncio.Context()
        self._own_ctx = context is None
        self._queue: asyncio.Queue[_Batch | _Clear | _Reconnect] = asyncio.Queue()
        self.stats.queue_depth = self._queue.qsize
        self.stats.sink_stats = self._sink_stats
        self.stats.sink_gauges = self._sink_gauges
        self._feeds: dict[str, _Feed] = {}
        self._gen = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._bind_socket: zmq.asyncio.Socket | None = None
        self.bound_endpoint: str | None = None
        self._running = False
        self._busy = False
        self._warned: dict[str, float] = {}
        if metrics_registry is not None:
            register_event_stats(self.stats, metrics_registry)

    def _warn(self, key: str, msg: str, *args: Any) -> None:
        """``log.warning`` at most once per ``WARN_EVERY_S`` per ``key`` (a pod sending
        garbage at a high rate must not flood the log); the counters count every one."""
        now = time.monotonic()
        if now - self._warned.get(key, -1e9) >= WARN_EVERY_S:
            self._warned[key] = now
            log.warning(msg, *args)

    def _sink_stats(self) -> dict[str, Any]:
        raw = getattr(self.sink, "stats", None)
        out: dict[str, Any] = {}
        if raw is None:
            pass
        elif hasattr(raw, "as_dict"):
            out = dict(raw.as_dict())
        elif callable(raw):
            out = dict(raw())
        extra = getattr(self.sink, "extra_stats", None)
        if callable(extra):
            out.update(extra())
        return out

    def _sink_gauges(self) -> dict[str, float]:
        fn = getattr(self.sink, "gauges", None)
        return dict(fn()) if callable(fn) else {}

    def _lost_events(self, pod: str) -> bool:
        fn = getattr(self.sink, "lost_events", None)
        return bool(fn(pod)) if fn is not None else False

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        if self._running:
            return
        self._running = True
        self._tasks.append(asyncio.create_task(self._writer(), name="kv-events-writer"))
        if self.settings.mode == "bind":
            sock = self._new_sub()
            sock.bind(self.settings.bind_endpoint)
            self.bound_endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            self._bind_socket = sock
            self._tasks.append(
                asyncio.create_task(self._bind_reader(sock), name="kv-events-bind-reader")
            )
            log.info("KV events: SUB bound on %s", self.bound_endpoint)
        self.registry.subscribe(self._on_pod)

    async def stop(self) -> None:
        self._running = False
        for feed in list(self._feeds.values()):
            self._close_feed(feed)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        if self._bind_socket is not None:
            self._bind_socket.close(linger=0)
            self._bind_socket = None
        if self._own_ctx:
            self._ctx.term()

    async def drain(self) -> None:
        """Wait until every queued batch has been handled (for tests and shutdown)."""
        while self._queue.qsize() or self._busy:
            await asyncio.sleep(0.005)

    # -- pods --------------------------------------------------------------------------

    def _on_pod(self, name: str, spec: PodSpec | None) -> None:
        if not self._running:
            return
        feed = self._feeds.get(name)
        if spec is None:
            if feed is not None:
                self._close_feed(feed)
                del self._feeds[name]
            self._queue.put_nowait(_Clear(name, "removed"))
            return
        model = _spec_model(spec, self.settings.model_fallback)
        if feed is not None:
            endpoint_changed = (
                feed.spec.events_endpoint != spec.events_endpoint
                or feed.spec.replay_endpoint != spec.replay_endpoint
            )
            feed.spec = spec
            if not feed.extra.get("topic_model"):
                feed.model = model
            if not endpoint_changed:
                return
            # a new publisher: start from scratch
            self._close_feed(feed)
            del self._feeds[name]
            self._queue.put_nowait(_Clear(name, "removed"))
        self._gen += 1
        feed = _Feed(name=name, spec=spec, gen=self._gen, model=model)
        self._feeds[name] = feed
        if self.settings.mode == "dial" and spec.events_endpoint:
            sock = self._new_sub()
            sock.connect(spec.events_endpoint)
            feed.socket = sock
            feed.reader = asyncio.create_task(
                self._dial_reader(feed, sock), name=f"kv-events-reader-{name}"
            )
            feed.monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            feed.watcher = asyncio.create_task(
                self._watch_connection(feed, feed.monitor), name=f"kv-events-monitor-{name}"
            )
            log.info("KV events: %s: SUB connected to %s", name, spec.events_endpoint)

    async def _watch_connection(self, feed: _Feed, monitor: zmq.asyncio.Socket) -> None:
        """A dropped connection may hide an engine restart whose first batches we miss
        (seq would then look like a gap, not a restart): resync at the reconnection."""
        while True:
            frames = await monitor.recv_multipart()
            try:
                event = parse_monitor_message(frames)
            except Exception:
                continue
            if event.get("event") == zmq.EVENT_DISCONNECTED:
                self._warn(
                    f"conn:{feed.name}", "KV events: %s: publisher connection lost", feed.name
                )
                self._queue.put_nowait(_Reconnect(feed.name, feed.gen))

    def _close_feed(self, feed: _Feed) -> None:
        if feed.reader is not None:
            feed.reader.cancel()
            feed.reader = None
        if feed.watcher is not None:
            feed.watcher.cancel()
            feed.watcher = None
        if feed.socket is not None:
            if feed.monitor is not None:
                with contextlib.suppress(zmq.ZMQError):
                    feed.socket.disable_monitor()
                feed.monitor.close(linger=0)
                feed.monitor = None
            feed.socket.close(linger=0)
            feed.socket = None

    def _new_sub(self) -> zmq.asyncio.Socket:
        sock = self._ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, self.settings.rcvhwm)
        sock.setsockopt(zmq.SUBSCRIBE, self.settings.topic_filter.encode())
        return sock

    # -- readers -----------------------------------------------------------------------

    def _split(self, frames: list[bytes], who: str) -> tuple[bytes, int, bytes] | None:
        """``[topic, seq, payload]`` -> parts, or None (counted) on bad framing."""
        if len(frames) != 3 or len(frames[1]) != 8:
            detail = (
                f"{len(frames)} frames, expected 3"
                if len(frames) != 3
                else f"seq frame of {len(frames[1])} bytes, expected 8"
            )
            self._warn(f"frame:{who}", "KV events: %s: malformed message skipped: %s", who, detail)
            return None
        return frames[0], int.from_bytes(frames[1], "big"), frames[2]

    def _enqueue(self, feed: _Feed, model: str, seq: int, payload: bytes) -> None:
        if self._queue.qsize() >= self.settings.queue_size:
            st = self.stats.pod(feed.name)
            st.dropped += 1
            if feed.drop_seq is None:
                feed.drop_seq = seq
                self._warn(
                    f"queue:{feed.name}",
                    "KV events: %s: queue full (%d), batch %d dropped, pod marked for resync",
                    feed.name,
                    self.settings.queue_size,
                    seq,
                )
            return
        self._queue.put_nowait(_Batch(feed.name, feed.gen, model, seq, payload))

    async def _pause(self, slice_end: float) -> float:
        """Yield to the loop when this task's time slice is over; the new slice's end.

        Awaiting a ready ZMQ message or a non-empty queue does not suspend, so without
        this a flood of batches would keep the loop from serving requests."""
        now = time.perf_counter()
        if now < slice_end:
            return slice_end
        await asyncio.sleep(0)
        return time.perf_counter() + self.settings.time_slice_s

    async def _recv(self, sock: zmq.asyncio.Socket, who: str) -> list[bytes] | None:
        """One message; None after a socket error (logged; the reader goes on)."""
        try:
            return await sock.recv_multipart()
        except zmq.ZMQError as exc:
            if exc.errno == zmq.ETERM:
                raise asyncio.CancelledError() from exc
            self._warn(f"recv:{who}", "KV events: %s: receive failed: %s", who, exc)
            await asyncio.sleep(0.1)
            return None

    async def _dial_reader(self, feed: _Feed, sock: zmq.asyncio.Socket) -> None:
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
                    if t.model:
                        model = feed.model = t.model
                        feed.extra["topic_model"] = True
            self._enqueue(feed, model, seq, payload)

    async def _bind_reader(self, sock: zmq.asyncio.Socket) -> None:
        slice_end = 0.0
        while True:
            slice_end = await self._pause(slice_end)
            frames = await self._recv(sock, "bind")
            if frames is None:
                continue
            topic_raw = frames[0] if frames else b""
            try:
                topic = parse_topic(topic_raw)
            except TopicError as exc:
                self.stats.bad_topics += 1
                self._warn("topic", "KV events: batch skipped: %s", exc)
                continue
            feed = self._feeds.get(topic.pod)
            if feed is None:
                self.stats.unknown_pod_batches += 1
                self._warn(
                    f"unknown:{topic.pod[:64]}",
                    "KV events: batch from unknown pod %r skipped",
                    topic.pod[:64],
                )
                continue
            parts = self._split(frames, topic.pod)
            if parts is None:
                self.stats.pod(topic.pod).malformed_frames += 1
                continue
            _, seq, payload = parts
            self._enqueue(feed, topic.model or feed.model, seq, payload)

    # -- writer ------------------------------------------------------------------------

    async def _writer(self) -> None:
        slice_end = 0.0
        while True:
            slice_end = await self._pause(slice_end)
            item = await self._queue.get()
            self._busy = True
            try:
                if isinstance(item, _Clear):
                    await self._clear(item.pod, item.reason, self._feeds.get(item.pod))
                elif isinstance(item, _Reconnect):
                    feed = self._feeds.get(item.pod)
                    if feed is not None and feed.gen == item.gen:
                        await self._resync(feed, "reconnect")
                        feed.joined = False  # the next batch re-learns from the replay buffer
                else:
                    await self._handle(item)
            except asyncio.CancelledError:
                raise
            except Exception:  # never let one batch kill the writer
                log.exception("KV events: unexpected error handling %r", item)
            finally:
                self._busy = False

    async def _clear(self, pod: str, reason: str, feed: _Feed | None) -> bool:
        self.stats.pod(pod).resyncs[reason] += 1
        try:
            remove_pod = getattr(self.sink, "remove_pod", None)
            if reason == "removed" and remove_pod is not None:
                await remove_pod(pod)
            else:
                await self.sink.clear_pod(pod)
        except Exception as exc:
            self._warn(
                f"clear:{pod}", "KV events: %s: clearing the pod failed (%s); will retry", pod, exc
            )
            if feed is not None:
                feed.dirty = True
            return False
        if feed is not None:
            feed.dirty = False
        log.info("KV events: %s: cleared (%s)", pod, reason)
        return True

    async def _resync(self, feed: _Feed, reason: str) -> None:
        feed.expected = None
        await self._clear(feed.name, reason, feed)

    async def _handle(self, b: _Batch) -> None:
        feed = self._feeds.get(b.pod)
        if feed is None or feed.gen != b.gen:
            return  # the pod went away (and was cleared) after this batch was queued
        st = self.stats.pod(b.pod)
        if feed.drop_seq is not None and b.seq > feed.drop_seq:
            feed.drop_seq = None
            await self._resync(feed, "overflow")
        elif feed.dirty:
            await self._resync(feed, "apply_error")
        exp = feed.expected
        if exp is None and not feed.joined:
            feed.joined = True
            if b.seq > 0 and self.settings.replay_on_join:
                await self._join_replay(feed, b.seq)
        if exp is not None and b.seq > exp:
            st.gaps += 1
            st.missed_batches += b.seq - exp
            self._warn(
                f"gap:{b.pod}", "KV events: %s: gap, expected seq %d, got %d", b.pod, exp, b.seq
            )
            if not await self._replay(feed, exp, b.seq):
                await self._resync(feed, "gap")
        elif exp is not None and b.seq < exp:
            st.restarts += 1
            self._warn(
                f"restart:{b.pod}",
                "KV events: %s: seq went back from %d to %d: engine restart",
                b.pod,
                exp,
                b.seq,
            )
            await self._resync(feed, "restart")
        await self._apply(feed, b.model, b.seq, b.payload)

    async def _join_replay(self, feed: _Feed, stop: int) -> None:
        """First batch of a pod already running: apply what its replay buffer holds
        before ``stop`` (best effort: blocks stored before the buffer's oldest batch stay
        unknown and their children show up as orphans)."""
        st = self.stats.pod(feed.name)
        endpoint = feed.spec.replay_endpoint
        if not endpoint:
            return
        try:
            batches = await fetch_replay(
                self._ctx, endpoint, 0, stop_seq=stop, timeout_s=self.settings.replay_timeout_s
            )
        except ReplayError as exc:
            st.replay_failures += 1
            self._warn(
                f"replay:{feed.name}", "KV events: %s: join replay failed: %s", feed.name, exc
            )
            return
        st.replays += 1
        for rb in batches:
            await self._apply(feed, feed.model, rb.seq, rb.payload)
            st.replayed_batches += 1
        log.info(
            "KV events: %s: joined at seq %d, replayed %d batches", feed.name, stop, len(batches)
        )

    async def _replay(self, feed: _Feed, start: int, stop: int) -> bool:
        st = self.stats.pod(feed.name)
        endpoint = feed.spec.replay_endpoint
        if not (self.settings.replay_on_gap and endpoint):
            return False
        try:
            batches = await fetch_replay(
                self._ctx,
                endpoint,
                start,
                stop_seq=stop,
                timeout_s=self.settings.replay_timeout_s,
            )
        except ReplayError as exc:
            st.replay_failures += 1
            self._warn(f"replay:{feed.name}", "KV events: %s: replay failed: %s", feed.name, exc)
            return False
        if [rb.seq for rb in batches] != list(range(start, stop)):
            st.replay_failures += 1
            first = batches[0].seq if batches else None
            self._warn(
                f"replay:{feed.name}",
                "KV events: %s: replay buffer does not cover seq %d..%d (first held: %s); "
                "resync from what it holds",
                feed.name,
                start,
                stop - 1,
                first,
            )
            # clear, then re-learn from the buffer: as if we had joined at its oldest batch
            await self._resync(feed, "gap")
            held = [rb for rb in batches if rb.seq < stop]
            if held and [rb.seq for rb in held] == list(range(held[0].seq, stop)):
                for rb in held:
                    await self._apply(feed, feed.model, rb.seq, rb.payload)
                    st.replayed_batches += 1
            return True
        st.replays += 1
        for rb in batches:
            await self._apply(feed, feed.model, rb.seq, rb.payload)
            st.replayed_batches += 1
        return True

    async def _apply(self, feed: _Feed, model: str, seq: int, payload: bytes) -> None:
        st = self.stats.pod(feed.name)
        feed.expected = seq + 1
        st.last_seq = seq
        try:
            batch = self.sink.decode(payload)
        except Exception as exc:
            st.decode_errors += 1
            self._warn(
                f"decode:{feed.name}",
                "KV events: %s: batch %d does not decode (%s); resync",
                feed.name,
                seq,
                exc,
            )
            await self._clear(feed.name, "decode_error", feed)
            return
        try:
            n = await self.sink.apply(feed.name, model, batch)
        except Exception as exc:
            st.apply_errors += 1
            self._warn(
                f"apply:{feed.name}",
                "KV events: %s: applying batch %d failed (%s); resync",
                feed.name,
                seq,
                exc,
            )
            feed.dirty = True
            return
        st.batches += 1
        st.events += n
        st.lag_s = max(0.0, time.time() - float(batch.ts))
        if self._lost_events(feed.name):
            self._warn(
                f"lost:{feed.name}",
                "KV events: %s: events were skipped in batch %d; resync",
                feed.name,
                seq,
            )
            await self._clear(feed.name, "lost_events", feed)
