"""One pod's subscription state: its own bounded queue, seq tracking, replay, faults.

Every pod has a :class:`PodFeed`; its reader appends to :attr:`PodFeed.pending`, the
writer takes from it.  Bounds are per pod, so one pod's flood never costs another pod
its batches:

* at most ``queue_size`` live batches wait per pod; beyond, the pod's batch is dropped
  and the pod (only it) is marked for resync (:meth:`PodFeed.note_drop`);
* a pod whose batches keep failing (undecodable, rejected, partly skipped: each costs a
  resync) more than ``fault_budget`` times in ``fault_window_s`` is **quarantined** for
  ``fault_window_s``: its messages are dropped unread, then it is resynced
  (:class:`FaultWindow`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Literal

import zmq
import zmq.asyncio

from router.events.replay import ReplayedBatch
from router.fleet.pods import PodSpec


@dataclass(slots=True)
class Batch:
    """A batch waiting for the writer (``replayed``: fetched from the replay socket)."""

    seq: int
    payload: bytes
    model: str
    replayed: bool = False


@dataclass(slots=True)
class Reconnect:
    """Re-learn the pod from its replay buffer at this point of its stream (queued in
    order with its batches): its dial-mode PUB connection dropped (``reconnect``), or
    the shared index lost its data (``data_loss``)."""

    reason: str = "reconnect"


@dataclass(slots=True)
class ReplayDone:
    """A replay of ``start .. stop - 1`` ended: its batches, or why it failed."""

    kind: Literal["gap", "join"]
    start: int
    stop: int
    batches: list[ReplayedBatch]
    error: str | None = None


Item = Batch | Reconnect | ReplayDone


class FaultWindow:
    """At most ``budget`` faults per ``window_s`` (a fixed window); beyond, quarantine
    until the window ends."""

    __slots__ = ("budget", "count", "quarantined_until", "start", "window_s")

    def __init__(self, budget: int, window_s: float) -> None:
        self.budget = budget
        self.window_s = window_s
        self.start = 0.0
        self.count = 0
        self.quarantined_until = 0.0

    def hit(self, now: float) -> bool:
        """Count one fault; True when it starts a quarantine."""
        if now - self.start >= self.window_s:
            self.start = now
            self.count = 0
        self.count += 1
        if self.count > self.budget and now >= self.quarantined_until:
            self.quarantined_until = self.start + self.window_s
            return True
        return False

    def quarantined(self, now: float) -> bool:
        return now < self.quarantined_until


@dataclass(eq=False)
class PodFeed:
    """Per-pod subscription state (identity equality: a replaced pod is a new feed)."""

    name: str
    spec: PodSpec
    model: str
    faults: FaultWindow
    #: next seq we expect (None: accept any, e.g. first batch or after a resync)
    expected: int | None = None
    #: seq of the first batch dropped (queue full, quarantine), not yet resynced
    drop_seq: int | None = None
    drop_reason: str = "overflow"
    #: the index may hold stale entries (a clear failed): clear before the next apply
    dirty: bool = False
    #: the first batch was seen (join replay done or not needed)
    joined: bool = False
    #: the model came from the topic (discovery's does not override it)
    topic_model: bool = False
    pending: deque[Item] = field(default_factory=deque)
    #: live batches in ``pending`` (what ``queue_size`` bounds)
    live: int = 0
    #: in the writer's ready queue
    scheduled: bool = False
    #: the pod left (or was replaced): the writer ignores it
    closed: bool = False
    replay: asyncio.Task[None] | None = None
    socket: zmq.asyncio.Socket | None = None
    reader: asyncio.Task[None] | None = None
    monitor: zmq.asyncio.Socket | None = None
    watcher: asyncio.Task[None] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def offer(self, batch: Batch, limit: int) -> bool:
        """Queue a live batch unless ``limit`` of them already wait."""
        if self.live >= limit:
            return False
        self.pending.append(batch)
        self.live += 1
        return True

    def take(self) -> Item:
        item = self.pending.popleft()
        if isinstance(item, Batch) and not item.replayed:
            self.live -= 1
        return item

    def put_back(self, item: Item) -> None:
        """Return ``item`` to the front (it is handled again after a replay)."""
        self.pending.appendleft(item)
        if isinstance(item, Batch) and not item.replayed:
            self.live += 1

    def note_drop(self, seq: int, reason: str) -> bool:
        """A batch of the pod was dropped; True for the first since the last resync."""
        if self.drop_seq is not None:
            return False
        self.drop_seq = seq
        self.drop_reason = reason
        return True

    def drop_pending(self) -> int:
        """Drop every batch and replay result waiting (quarantine); reconnects stay.
        Returns how many live batches were dropped."""
        dropped = self.live
        self.pending = deque(i for i in self.pending if isinstance(i, Reconnect))
        self.live = 0
        return dropped
