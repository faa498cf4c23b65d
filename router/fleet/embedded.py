"""The embedded simulated fleet: N :class:`~router.sim.pod.SimPod` on free loopback ports.

`kvroute serve` starts it when no pods are configured, so the router answers at once on
a fresh machine.  The pods run on their own event loop in a daemon thread of the parent
process (uvicorn worker processes are separate, so the fleet must not live in any of
them); :meth:`EmbeddedFleet.attach` points a :class:`Settings` at them (static
discovery, KV events dialled from each pod's publisher).

:func:`start_pods` is the in-loop variant (tests, benchmarks).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence

from router.config import Settings
from router.config_sections import FleetSettings
from router.fleet.discovery import StaticPod
from router.sim.pod import SimPod
from router.sim.settings import SimSettings


def sim_settings(fleet: FleetSettings, i: int, **overrides: object) -> SimSettings:
    """Settings of the fleet's pod ``i`` (:meth:`FleetSettings.roles` order: ``sim-<i>``
    of role both, then ``sim-p<i>`` prefill, ``sim-d<i>`` decode)."""
    name, role = fleet.roles()[i]
    base: dict[str, object] = {
        "model": fleet.model,
        "pod_name": name,
        "role": role,
        "block_size": fleet.block_size,
        "capacity_tokens": fleet.capacity_tokens,
        "prefill_rate": fleet.prefill_tokens_per_s,
        "decode_rate": fleet.decode_tokens_per_s,
        "kv_events": True,
    }
    base.update(overrides)
    return SimSettings.model_validate(base)


async def start_pods(settings: Sequence[SimSettings]) -> list[SimPod]:
    """Start one SimPod per settings in the running loop (stopped again on failure)."""
    pods: list[SimPod] = []
    try:
        for s in settings:
            pod = SimPod(s)
            await pod.start()
            pods.append(pod)
    except BaseException:
        await stop_pods(pods)
        raise
    return pods


async def stop_pods(pods: Sequence[SimPod]) -> None:
    for pod in pods:
        await pod.stop()


def static_pods(pods: Sequence[SimPod]) -> list[StaticPod]:
    """Static-discovery entries for running sim pods."""
    return [
        StaticPod(
            name=p.name,
            url=p.url,
            events_endpoint=p.events_endpoint,
            replay_endpoint=p.replay_endpoint_url,
            models=[p.settings.model, *p.settings.lora_adapters],
            role=p.settings.role,
        )
        for p in pods
    ]


def _new_loop() -> asyncio.AbstractEventLoop:
    """uvloop when installed: it sets TCP_NODELAY on every TCP socket, where asyncio
    skips sockets created without ``IPPROTO_TCP`` (as SimPod's listening socket is)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


_THREAD = "kvroute-fleet"


class _QuietFleetServers(logging.Filter):
    """Drops the pods' uvicorn lifecycle lines ("Shutting down", "Finished server
    process"): uvicorn logs them on one process-wide logger, at the router's level, so
    a 4-pod fleet printed them five times at every stop."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.threadName != _THREAD or record.levelno >= logging.WARNING


_QUIET = _QuietFleetServers()


class EmbeddedFleet:
    """A simulated fleet on a background thread's event loop."""

    def __init__(self, settings: FleetSettings) -> None:
        self.settings = settings
        self.pods: list[SimPod] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self, timeout_s: float = 30.0) -> None:
        loop = _new_loop()
        self._loop = loop
        logging.getLogger("uvicorn.error").addFilter(_QUIET)
        self._thread = threading.Thread(target=loop.run_forever, name=_THREAD, daemon=True)
        self._thread.start()
        configs = [sim_settings(self.settings, i) for i in range(len(self.settings.roles()))]
        fut = asyncio.run_coroutine_threadsafe(start_pods(configs), loop)
        self.pods = fut.result(timeout_s)

    def attach(self, settings: Settings) -> Settings:
        """A copy of ``settings`` routing to this fleet (static discovery)."""
        discovery = settings.discovery.model_copy(
            update={"kind": "static", "static": static_pods(self.pods)}
        )
        return settings.model_copy(update={"discovery": discovery})

    def stop(self, timeout_s: float = 10.0) -> None:
        loop = self._loop
        if loop is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(stop_pods(self.pods), loop).result(timeout_s)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            if self._thread is not None:
                self._thread.join(timeout_s)
            loop.close()
            self._loop = None
            self.pods = []
