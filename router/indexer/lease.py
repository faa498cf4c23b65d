"""One KV-event writer per Redis namespace: a lease in Redis.

The writer (`kvroute index`, or a `kvroute serve` replica with ``index_writer``) claims
the namespace's writer lease every ``lease_s / 3`` seconds; the lease expires ``lease_s``
after the last claim, so a writer that dies frees it.  Two writers would apply every
event twice, and each one's resyncs would clear pods under the other's bookkeeping.

* ``standby=True`` (`kvroute index`): a second process finds the lease taken and waits
  as a hot standby (:attr:`acquired` is set when it takes the lease over; it starts
  writing only then).  A holder whose lease was taken by another process (it stalled
  past ``lease_s``) sets :attr:`lost`: it must stop writing at once (the indexer exits,
  to come back as a standby).
* ``standby=False`` (a router replica): it writes regardless; a lease held by someone
  else is logged as an error naming the holder and raises
  ``kvroute_index_writer_conflict`` to 1 (an index fed twice is better than none while
  the operator fixes the deployment); when the lease frees it takes it over.

``kvroute_index_writer_active`` is 1 while this process holds the lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Gauge

if TYPE_CHECKING:
    from scoring.index.redis import RedisIndex

log = logging.getLogger(__name__)

#: the lease's lifetime after the last claim (claims come every third of it)
LEASE_S = 15.0


def holder_id() -> str:
    """This process, as the lease names it: host, pid and a random tag."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


class WriterLease:
    def __init__(
        self,
        index: RedisIndex,
        registry: CollectorRegistry,
        *,
        lease_s: float = LEASE_S,
        holder: str | None = None,
        standby: bool = False,
    ) -> None:
        self.index = index
        self.lease_s = lease_s
        self.holder = holder or holder_id()
        self.standby = standby
        #: who else holds the lease while this process writes too (None: this process
        #: holds it, nobody answered yet, or this is a standby that does not write)
        self.conflict: str | None = None
        #: who holds the lease while this standby waits
        self.waiting_for: str | None = None
        #: this process holds the lease
        self.held = False
        #: set when this process takes the lease (a standby starts writing then)
        self.acquired = asyncio.Event()
        #: set when another process took the lease from this one (stop writing)
        self.lost = asyncio.Event()
        self._gauge = Gauge(
            "kvroute_index_writer_conflict",
            "1 while another process holds this Redis namespace's writer lease "
            "(two processes apply the same KV events)",
            registry=registry,
        )
        self._active = Gauge(
            "kvroute_index_writer_active",
            "1 while this process holds its Redis namespace's writer lease",
            registry=registry,
        )

    async def run(self) -> None:
        """Claim the lease until cancelled (a failed claim is logged and retried)."""
        while True:
            try:
                self._note(await self.index.claim_writer(self.holder, self.lease_s))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("writer lease of namespace %r: %s", self.index.namespace, exc)
            await asyncio.sleep(self.lease_s / 3)

    async def release(self) -> None:
        with contextlib.suppress(Exception):
            await self.index.release_writer(self.holder)

    def _note(self, other: str | None) -> None:
        was_held = self.held
        self.held = other is None
        self._active.set(1 if self.held else 0)
        if self.held and not was_held:
            self.acquired.set()
        if self.standby:
            self._note_standby(other, was_held)
        else:
            self._note_conflict(other)

    def _note_standby(self, other: str | None, was_held: bool) -> None:
        ns = self.index.namespace
        if other is None:
            if not was_held:
                log.info("writer lease of namespace %r taken: this process writes", ns)
        elif was_held:
            self.lost.set()
            log.error(
                "the writer lease of namespace %r was taken by %s (this process stalled "
                "past the lease's %gs): this process stops writing",
                ns,
                other,
                self.lease_s,
            )
        elif other != self.waiting_for:
            log.info(
                "standby: %s writes the KV-event index of namespace %r; this process takes "
                "over when that lease is given up or expires",
                other,
                ns,
            )
        self.waiting_for = other

    def _note_conflict(self, other: str | None) -> None:
        if other != self.conflict:
            if other is not None:
                log.error(
                    "another process (%s) writes the KV-event index in Redis namespace %r: "
                    "every event is applied twice and each writer's resyncs clear pods under "
                    "the other. Run one `kvroute index` per namespace, with index_writer "
                    "false on the routers",
                    other,
                    self.index.namespace,
                )
            else:
                log.info("writer lease of namespace %r taken", self.index.namespace)
        self.conflict = other
        self._gauge.set(1 if other is not None else 0)
