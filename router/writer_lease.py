"""One KV-event writer per Redis namespace: a lease that makes a second writer loud.

`kvroute index` (and a `kvroute serve --index-writer` replica) claims the namespace's
writer lease in Redis every ``lease_s / 3`` seconds; the lease expires ``lease_s`` after
the last claim, so a writer that dies frees it.  A second writer finds it taken: it logs
an error naming the holder and sets ``kvroute_index_writer_conflict`` to 1 -- two writers
apply every event twice and each one's resync clears pods under the other's bookkeeping.
It goes on writing (an index fed twice is better than none while the operator fixes the
deployment); when the lease frees it takes it over.
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
    ) -> None:
        self.index = index
        self.lease_s = lease_s
        self.holder = holder or holder_id()
        #: who else holds the lease (None: this process does, or nobody answered yet)
        self.conflict: str | None = None
        self._gauge = Gauge(
            "kvroute_index_writer_conflict",
            "1 while another process holds this Redis namespace's writer lease "
            "(two processes apply the same KV events)",
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
