"""Prefill/decode disaggregation in the simulated pod, as vLLM's NixlConnector (pull
mode) does it; the facts and their sources are in docs/pd.md.

**Prefill side** (role ``prefill`` or ``both``).  A request whose ``kv_transfer_params``
say ``do_remote_decode: true`` runs as usual (the router sends it with ``max_tokens: 1``);
when it finishes by length or stop (vLLM's ``request_finished``: not on abort or error)
the full blocks of its prompt are *pinned* in the cache under a lease and the response
carries top-level ``kv_transfer_params``::

    {"do_remote_prefill": true, "do_remote_decode": false, "remote_block_ids": [...],
     "remote_engine_id": ..., "remote_request_id": ..., "remote_host": ...,
     "remote_port": ..., "tp_size": 1}

Pinned blocks cannot be evicted and count in ``kv_cache_usage_perc``.  The lease ends
when a decode pod pulls the blocks or after ``kv_lease_s`` wall seconds (vLLM's
``kv_lease_duration``, 30 s); either way the blocks stay cached, only evictable again
(vLLM frees them to its free queue with their hashes).  No heartbeats: a decode pod
queued past the lease finds the lease gone.

**Decode side** (role ``decode`` or ``both``).  A request with ``do_remote_prefill:
true`` first counts what its own cache holds, then pulls the rest of the prompt's full
blocks from the named pod: ``POST {remote_host}:{remote_port}/kvroute_sim/kv_read``
(the sim's stand-in for the NIXL side channel; its HTTP port), charged
``kv_transfer_s_per_block`` each, while the request waits (the pull holds no prefill
slot, as vLLM's async load parks the request in ``WAITING_FOR_REMOTE_KVS``).  The pulled
blocks enter the decode pod's cache and are published as ``BlockStored`` (vLLM caches
them with ``cache_blocks`` after the load, which emits the event); only the blocks found
locally count as prefix-cache hits, while the response's ``cached_tokens`` counts local
and pulled blocks (vLLM reports nearly the whole prompt as cached on the decode pod).

Params without ``remote_block_ids`` or one of ``remote_engine_id``,
``remote_request_id``, ``remote_host``, ``remote_port`` are ignored and the prompt
computed locally (vLLM logs "Got invalid KVTransferParams" and does the same).  A pull
that fails (unknown engine or lease, expired lease, blocks that are not this prompt's,
a host outside ``kv_peer_hosts``, an unreachable pod) follows
``kv_load_failure_policy``: ``fail`` (vLLM's default) answers 500, ``recompute``
computes the prompt locally.  Outcomes are counted in
``kvroute_sim_kv_transfers_total{outcome}``.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse
from prometheus_client import Counter, Gauge

from router.sim.engine import SimEngine, SimRequest
from router.sim.settings import SimSettings

READ_PATH = "/kvroute_sim/kv_read"
_REMOTE_FIELDS = ("remote_engine_id", "remote_request_id", "remote_host", "remote_port")


class KVLoadError(RuntimeError):
    """A pull of remote blocks failed; the message says why."""


@dataclass(slots=True)
class _Lease:
    keys: list[int]
    timer: asyncio.TimerHandle


@dataclass(slots=True)
class PDRequest:
    """What one request's ``kv_transfer_params`` ask of this pod."""

    request_id: str
    #: prefill side: hold the blocks and return params when done
    hold: bool = False
    #: decode side: pull the prompt's blocks from here first (validated params)
    pull: Mapping[str, Any] | None = None


class SimDisagg:
    """The P/D side of one simulated pod (leases, pulls, the read endpoint)."""

    def __init__(self, settings: SimSettings, engine: SimEngine) -> None:
        self.settings = settings
        self.engine = engine
        self.engine_id = settings.kv_engine_id
        #: (host, port) decode pods dial to read blocks; set by SimPod once serving
        self.side_channel: tuple[str, int] | None = None
        self._leases: dict[str, _Lease] = {}
        self._client: httpx.AsyncClient | None = None
        r = engine.metrics.registry
        self.transfers = Counter(
            "kvroute_sim_kv_transfers",
            "P/D block pulls by this (decode) pod, by outcome.",
            ["outcome"],
            registry=r,
        )
        self.pulled_blocks = Counter(
            "kvroute_sim_kv_pulled_blocks", "Blocks pulled from prefill pods.", registry=r
        )
        self.expired = Counter(
            "kvroute_sim_kv_expired_leases",
            "Leases that expired before a decode pod pulled their blocks.",
            registry=r,
        )
        Gauge(
            "kvroute_sim_kv_leased_blocks",
            "Blocks held for decode pods to pull.",
            registry=r,
        ).set_function(lambda: float(sum(len(x.keys) for x in self._leases.values())))

    # -- the request's params ---------------------------------------------------------

    def parse(self, body: Mapping[str, Any], headers: Mapping[str, str]) -> PDRequest:
        """What ``body["kv_transfer_params"]`` asks of this pod (by its role)."""
        rid = headers.get("x-request-id") or uuid.uuid4().hex
        params = body.get("kv_transfer_params")
        out = PDRequest(request_id=rid)
        if not isinstance(params, Mapping):
            return out
        role = self.settings.role
        if params.get("do_remote_decode") and role in ("prefill", "both"):
            out.hold = True
        elif params.get("do_remote_prefill") and role in ("decode", "both"):
            if params.get("remote_block_ids") and all(f in params for f in _REMOTE_FIELDS):
                out.pull = params
            else:  # vLLM: "Got invalid KVTransferParams ... will not utilize KVTransfer"
                self.transfers.labels("invalid_params").inc()
        return out

    # -- prefill side -----------------------------------------------------------------

    def hold(self, pd: PDRequest, req: SimRequest) -> dict[str, Any] | None:
        """Pin ``req``'s prompt blocks under a lease; the params the response carries
        (None when the request did not finish by length or stop)."""
        if not pd.hold or req.finish_reason not in ("length", "stop"):
            return None
        lease_id = f"{pd.request_id}-{uuid.uuid4().hex[:8]}"
        # the chain still cached (a block evicted since the prefill ends what D can use)
        cached = self.engine.cache.match(req.block_hashes)
        keys = self.engine.cache.pin(req.block_hashes[:cached])
        if keys:
            loop = asyncio.get_running_loop()
            timer = loop.call_later(self.settings.kv_lease_s, self._expire, lease_id)
            self._leases[lease_id] = _Lease(keys, timer)
        host, port = self.side_channel or (self.settings.host, self.settings.port)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": keys,
            "remote_engine_id": self.engine_id,
            "remote_request_id": lease_id,
            "remote_host": host,
            "remote_port": port,
            "tp_size": 1,
        }

    def _expire(self, lease_id: str) -> None:
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            self.engine.cache.unpin(lease.keys)
            self.expired.inc()

    def release(self, lease_id: str) -> list[int] | None:
        """End a lease (its blocks were read); its keys, None when unknown/expired."""
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return None
        lease.timer.cancel()
        self.engine.cache.unpin(lease.keys)
        return lease.keys

    @property
    def leased_blocks(self) -> int:
        return sum(len(x.keys) for x in self._leases.values())

    async def read_endpoint(self, request: Request) -> JSONResponse:
        """``POST /kvroute_sim/kv_read``: a decode pod reads a lease's blocks (and so
        ends the lease).  404 names an unknown engine or lease."""
        try:
            body = await request.json()
            engine_id, lease_id = body["remote_engine_id"], body["remote_request_id"]
        except (ValueError, KeyError, TypeError):
            return _error(400, "body must be {remote_engine_id, remote_request_id}")
        if engine_id != self.engine_id:
            return _error(404, f"engine {engine_id!r} is not this pod ({self.engine_id!r})")
        keys = self.release(str(lease_id))
        if keys is None:
            return _error(404, f"no lease {lease_id!r} (never granted, pulled or expired)")
        return JSONResponse({"block_ids": keys, "block_size": self.settings.block_size})

    # -- decode side ------------------------------------------------------------------

    async def receive(self, pd: PDRequest, req: SimRequest) -> None:
        """Pull ``req``'s missing prompt blocks per ``pd.pull`` into the cache (events
        published); on failure raise :class:`KVLoadError` or, with the ``recompute``
        policy, leave the prompt to be computed locally."""
        if pd.pull is None:
            return
        engine = self.engine
        local_blocks = engine.cache.match(req.block_hashes)
        req.local_hit_tokens = engine.cached_tokens(req)
        try:
            keys = await self._read(pd.pull)
            if keys != req.block_hashes[: len(keys)]:
                raise KVLoadError("the remote blocks are not this prompt's blocks")
        except KVLoadError:
            self.transfers.labels("failed").inc()
            if self.settings.kv_load_failure_policy == "fail":
                raise
            return
        missing = max(0, len(keys) - local_blocks)
        await engine.sleep(missing * self.settings.kv_transfer_s_per_block)
        if missing:
            engine._store(req, keys, req.prompt_ids, local_blocks)
        self.transfers.labels("ok").inc()
        self.pulled_blocks.inc(missing)

    async def _read(self, params: Mapping[str, Any]) -> list[int]:
        host, port = str(params["remote_host"]), params["remote_port"]
        if host not in self.settings.kv_peer_hosts:
            raise KVLoadError(f"remote_host {host!r} is not in kv_peer_hosts")
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=10.0)
        url = f"http://{'[' + host + ']' if ':' in host else host}:{port}{READ_PATH}"
        try:
            r = await self._client.post(
                url,
                json={
                    "remote_engine_id": params["remote_engine_id"],
                    "remote_request_id": params["remote_request_id"],
                },
            )
        except httpx.HTTPError as exc:
            raise KVLoadError(f"reading blocks from {host}:{port} failed: {exc}") from None
        if r.status_code != 200:
            raise KVLoadError(f"{host}:{port} refused the read: {r.text[:200]}")
        return [int(k) for k in r.json()["block_ids"]]

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        for lease_id in list(self._leases):
            self.release(lease_id)


def _error(status: int, message: str) -> JSONResponse:
    kind = "NotFoundError" if status == 404 else "BadRequestError"
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": status}},
        status_code=status,
    )
