"""The simulated engine: an LRU prefix cache, a FCFS prefill queue and batched decode.

Time model, per request (all delays x ``time_scale``):

* it waits FCFS for the single prefill engine and for a running slot
  (at most ``max_batch`` requests run); the wait is the *queue time*;
* prefill takes ``uncached / prefill_rate`` seconds, where
  ``uncached = prompt tokens - cached tokens`` and
  ``cached = block_size x min(leading blocks in the cache, (prompt tokens - 1) // block_size)``
  (vLLM always recomputes the last prompt token), so
  ``TTFT = queue time + uncached / prefill_rate``;
* then one token every ``1 / decode_rate`` seconds.

Cache and events follow vLLM (V1 caches a prefill's blocks when it schedules them, not
when it has computed them): when prefill starts the prompt's full blocks are stored
(one ``BlockStored`` for the blocks it computes; blocks served from cache are only
touched and emit nothing — but a fully cached block-aligned prompt recomputes, and
re-publishes, its last block); blocks evicted to make room emit one ``BlockRemoved``
each; when the request ends, the full blocks of ``prompt + output[:-1]`` (the last
sampled token is never fed back, so it has no KV) are stored.  Prefix-cache counters count tokens:
``queries += prompt tokens``, ``hits += cached tokens``.
``kv_cache_usage_perc`` = blocks held by running requests, and blocks a prefill pod
holds for a decode pod to pull (router.sim.disagg), / cache blocks (cached but idle
blocks count as free, as in vLLM).
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from router.sim.events import EventFactory, KVCacheEvent
from router.sim.hashing import EngineHasher, wire_hash
from router.sim.metrics import SimMetrics
from router.sim.settings import SimSettings
from scoring.simcache import PrefixCache

#: the deterministic output: printable ASCII, so the builtin tokenizer (token = byte)
#: re-tokenizes an answer to the very ids the pod generated (multi-turn chats hit)
OUTPUT_TEXT = (
    "The quick brown fox jumps over the lazy dog while the cache keeps every "
    "prefix warm and the router sends each turn home. "
)

EventSink = Callable[[list[KVCacheEvent]], object]
Sleeper = Callable[[float], Awaitable[None]]


@dataclass
class SimRequest:
    """One generation request, already tokenized."""

    prompt_ids: list[int]
    max_tokens: int
    lora: str | None = None
    cache_salt: str | None = None
    #: P/D decode side: prompt tokens the local cache held before remote blocks were
    #: pulled in (None: no pull); only these count as prefix-cache hits, as in vLLM
    local_hit_tokens: int | None = None
    # filled in by the engine
    block_hashes: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    queue_time: float = 0.0
    ttft: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None


def output_token(prompt_ids: list[int], i: int) -> int:
    """Token ``i`` of the deterministic answer to ``prompt_ids``."""
    start = sum(prompt_ids[-8:]) % len(OUTPUT_TEXT)
    return ord(OUTPUT_TEXT[(start + i) % len(OUTPUT_TEXT)])


def output_text(token_ids: list[int]) -> str:
    return "".join(chr(t) for t in token_ids)


class SimEngine:
    def __init__(self, settings: SimSettings, *, sleep: Sleeper | None = None) -> None:
        """``sleep(seconds)`` waits one simulated delay (already x ``time_scale``);
        default ``asyncio.sleep``.  Tests pass a recorder to check the time model."""
        self.settings = settings
        self._sleeper: Sleeper = sleep or asyncio.sleep
        self.block_size = settings.block_size
        self.cache = PrefixCache(settings.capacity_blocks)
        self.hasher = EngineHasher(settings.block_size, settings.hash_seed, settings.hash_algo)
        self.events = EventFactory(settings.encoding)
        #: where event batches go (set by the pod once its publisher runs)
        self.sink: EventSink | None = None
        self.waiting = 0
        self.running = 0
        self._copies: dict[int, int] = {}  # hash -> physical copies (>= 1 while cached)
        self._active: dict[int, int] = {}  # request id -> tokens holding KV
        self._ids = itertools.count()
        self._prefill_lock = asyncio.Lock()
        self._slots = asyncio.Semaphore(settings.max_batch)
        self._lora_ids = {name: i + 1 for i, name in enumerate(settings.lora_adapters)}
        self.metrics = SimMetrics(
            settings,
            running=lambda: float(self.running),
            waiting=lambda: float(self.waiting),
            kv_usage=self.kv_usage,
        )

    # -- state ---------------------------------------------------------------------

    def kv_usage(self) -> float:
        bs = self.block_size
        used = sum(-(-t // bs) for t in self._active.values()) + self.cache.pinned_blocks
        return min(1.0, used / max(1, self.settings.capacity_blocks))

    def prepare(self, req: SimRequest) -> SimRequest:
        req.block_hashes = self.hasher.chain(
            req.prompt_ids, lora=req.lora, cache_salt=req.cache_salt
        )
        return req

    def cached_tokens(self, req: SimRequest) -> int:
        """Tokens of ``req``'s prompt the cache would serve now."""
        limit = max(0, (len(req.prompt_ids) - 1) // self.block_size)
        return self.block_size * min(self.cache.match(req.block_hashes), limit)

    async def close(self) -> None:
        """Stop background work (none here; the vLLM model's step loop)."""

    def reset_prefix_cache(self) -> None:
        """Drop every cached block and publish AllBlocksCleared."""
        self.cache.clear()
        self._copies.clear()
        self._emit([self.events.cleared()])

    # -- events --------------------------------------------------------------------

    def _emit(self, events: list[KVCacheEvent]) -> None:
        if events and self.sink is not None:
            self.sink(events)

    def _extra_keys(self, req: SimRequest, block: int) -> tuple[Any, ...] | None:
        keys: tuple[Any, ...] = ()
        if req.lora:
            keys += (req.lora,)
        if block == 0 and req.cache_salt:
            keys += (req.cache_salt,)
        return keys or None

    def _store(self, req: SimRequest, keys: list[int], tokens: list[int], start: int) -> None:
        """Cache the chain ``keys`` (full blocks of ``tokens``) after computing blocks
        ``start:`` of it, and publish what changed, in vLLM's order: removals that
        made room, then one ``BlockStored`` for the computed blocks, then removals of
        blocks of this very chain when it does not fit.

        Like vLLM, every computed block is published, even when its hash is already
        cached (a block-aligned prompt recomputes its last block; identical requests
        computed concurrently): that is a second physical copy of the hash, and its
        eviction publishes one ``BlockRemoved`` per copy.  Copies do not take extra
        capacity here.
        """
        stored, evicted = self.cache.insert(keys)
        pos = {k: i for i, k in enumerate(keys)}
        # blocks we counted as hits but that were evicted meanwhile are computed too
        first = min([start, *(pos[k] for k in stored)])
        copies = self._copies
        for k in keys[first:]:
            copies[k] = copies.get(k, 0) + 1
        wire = self.settings.int_hashes
        ev = self.events
        events: list[KVCacheEvent] = []
        tail: list[KVCacheEvent] = []
        for k in evicted:
            removed = [ev.removed(wire_hash(k, wire))] * copies.pop(k, 1)
            (tail if k in pos and pos[k] >= first else events).extend(removed)
        if first < len(keys):
            events.append(self._stored_event(req, keys, tokens, first))
        self._emit(events + tail)

    def _stored_event(
        self, req: SimRequest, keys: list[int], tokens: list[int], first: int
    ) -> KVCacheEvent:
        wire = self.settings.int_hashes
        bs = self.block_size
        return self.events.stored(
            [wire_hash(k, wire) for k in keys[first:]],
            wire_hash(keys[first - 1], wire) if first > 0 else None,
            tokens[first * bs : len(keys) * bs],
            bs,
            lora_id=self._lora_ids.get(req.lora) if req.lora else None,
            lora_name=req.lora,
            extra_keys=[self._extra_keys(req, i) for i in range(first, len(keys))],
        )

    # -- time ----------------------------------------------------------------------

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` of simulated time (x ``time_scale``) with the engine's sleeper."""
        scale = self.settings.time_scale
        await self._sleeper(seconds * scale if scale > 0 else 0.0)

    _sleep = sleep

    async def generate(self, req: SimRequest) -> AsyncGenerator[int, None]:
        """Yield ``req``'s output tokens at their simulated times.

        Close the iterator (``contextlib.aclosing``) when stopping early: the request
        then ends as aborted, keeping the KV of the tokens computed so far.
        """
        loop = asyncio.get_running_loop()
        arrival = loop.time()
        rid = next(self._ids)
        m = self.metrics
        waiting, admitted, prefilled = True, False, False
        self.waiting += 1
        try:
            async with self._prefill_lock:
                await self._slots.acquire()
                admitted = True
                self.waiting -= 1
                waiting = False
                self.running += 1
                req.queue_time = loop.time() - arrival
                m.queue_time.observe(req.queue_time)
                n = len(req.prompt_ids)
                req.cached_tokens = self.cached_tokens(req)
                m.prefix_cache_queries.inc(n)
                hits = req.cached_tokens
                if req.local_hit_tokens is not None:
                    hits = min(hits, req.local_hit_tokens)
                m.prefix_cache_hits.inc(hits)
                m.prompt_tokens.inc(n)
                self._active[rid] = n
                # vLLM V1 caches a prefill's full blocks when it schedules them, before the
                # step computes them (KVCacheManager.allocate_slots -> cache_blocks), and
                # evicts for room then too: BlockStored / BlockRemoved go out at the
                # prefill's start, as in the replay's pod (scoring/replay/simpod.py)
                self._store(
                    req, req.block_hashes, req.prompt_ids, req.cached_tokens // self.block_size
                )
                await self._sleep((n - req.cached_tokens) / self.settings.prefill_rate)
                prefilled = True
            req.ttft = loop.time() - arrival
            m.time_to_first_token.observe(req.ttft)
            m.prefill_time.observe(req.ttft - req.queue_time)
            first_at = last_at = loop.time()
            for i in range(req.max_tokens):
                if i:
                    await self._sleep(1.0 / self.settings.decode_rate)
                tok = output_token(req.prompt_ids, i)
                req.output_ids.append(tok)
                self._active[rid] = n + i
                m.generation_tokens.inc()
                if i:
                    m.inter_token_latency.observe(loop.time() - last_at)
                last_at = loop.time()
                yield tok
            req.finish_reason = "length"
            m.decode_time.observe(last_at - first_at)
        finally:
            if waiting:
                self.waiting -= 1
            if admitted:
                self._slots.release()
                self.running -= 1
            self._active.pop(rid, None)
            if prefilled:
                self._finish(req, arrival, loop.time())

    def _finish(self, req: SimRequest, arrival: float, now: float) -> None:
        reason = req.finish_reason or "abort"
        req.finish_reason = reason
        self.metrics.request_success[reason].inc()
        self.metrics.e2e_latency.observe(now - arrival)
        tokens = req.prompt_ids + req.output_ids[:-1]
        keys = self.hasher.chain(
            tokens, lora=req.lora, cache_salt=req.cache_salt, prefix=req.block_hashes
        )
        if len(keys) > len(req.block_hashes):
            self._store(req, keys, tokens, len(req.block_hashes))
