"""The simulated pod on the replay's vLLM engine model, in real time (``--pod-model vllm``).

The same :class:`~scoring.replay.vllm_sched.Scheduler` and
:class:`~scoring.replay.step_cost.StepCost` the replay's ``--pod-model vllm`` runs
(continuous batching under ``max_num_batched_tokens`` / ``max_num_seqs``, chunked
prefill mixed with decodes, KV blocks as the one resource, prefix-cache lookup when a
request is scheduled, LRU eviction of free blocks only, preemption by recompute), with
the parameters of a preset (``--preset`` / ``--preset-file``).  One driver task runs
engine steps back to back while there is work: plan a step, sleep its modelled time
(x ``time_scale``), sample — each step separately (no decode-run fast-forward), so
tokens stream at their step times.

What a client and the router see is what :class:`~router.sim.engine.SimEngine` gives:
the same deterministic output, the same HTTP API, and KV events as vLLM publishes
them — one ``BlockStored`` per batch of blocks a request fills in a step (prompt and
generated blocks alike, their keys the engine hash of prompt + output, so a chat's
next turn hits its previous answer), one ``BlockRemoved`` per cached block an
allocation evicts, in the order they happen.  Metrics are vLLM's: queue time (arrival
to first scheduled), prefill time (first scheduled to first token), decode time,
TTFT, prefix-cache queries and hits counted when a request is first scheduled,
``kv_cache_usage_perc`` = blocks held by running requests / all blocks.

A preset's ``request_overhead_s`` (the engine's API-server latency, which the replay
adds to each TTFT) is slept before the request reaches the scheduler, on top of this
process's own HTTP handling.

Not modelled here: P/D roles (``role`` must be ``both``); vLLM's reset of the prefix
cache is refused while requests hold blocks, as vLLM refuses it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field

from router.sim.engine import SimEngine, SimRequest, Sleeper, output_token
from router.sim.events import KVCacheEvent
from router.sim.hashing import wire_hash
from router.sim.settings import SimSettings
from scoring.replay.kv_blocks import BlockPool
from scoring.replay.vllm_sched import Scheduler, Seq


@dataclass(slots=True, eq=False)
class _Live:
    """A request the driver serves, and where its tokens go."""

    req: SimRequest
    seq: Seq
    tokens: list[int]  # prompt + output[:-1]: the tokens that get KV
    outputs: list[int]
    arrival: float
    queue: asyncio.Queue[int] = field(default_factory=asyncio.Queue)
    scheduled_at: float | None = None
    first_at: float | None = None
    done: bool = False


class VllmSimEngine(SimEngine):
    """A :class:`SimEngine` whose time and cache are the vLLM scheduler's."""

    def __init__(self, settings: SimSettings, *, sleep: Sleeper | None = None) -> None:
        super().__init__(settings, sleep=sleep)
        self.spec = settings.engine_spec()
        self.sched = Scheduler(
            self.spec.cost,
            num_blocks=settings.capacity_blocks,
            block_size=settings.block_size,
            max_num_batched_tokens=self.spec.max_num_batched_tokens,
            max_num_seqs=self.spec.max_num_seqs,
            fast_forward=False,
        )
        self.sched.on_cache = self._on_cache
        self.sched.pool.on_evict = self._on_evict
        self._live: dict[int, _Live] = {}
        #: request id -> (request, tokens with KV) while its seq is in the scheduler, so
        #: blocks a step fills after its client went away are still published
        self._kv_src: dict[int, tuple[SimRequest, list[int]]] = {}
        self._pending: list[KVCacheEvent] = []
        self._aborts: list[Seq] = []
        self._driver: asyncio.Task[None] | None = None

    # -- state ---------------------------------------------------------------------

    def kv_usage(self) -> float:
        return self.sched.pool.usage

    def cached_tokens(self, req: SimRequest) -> int:
        limit = max(0, (len(req.prompt_ids) - 1) // self.block_size)
        return self.block_size * min(self.sched.pool.hit_blocks(req.block_hashes), limit)

    def reset_prefix_cache(self) -> None:
        """Drop every cached block (AllBlocksCleared), unless requests hold blocks:
        vLLM then refuses (``reset_prefix_cache`` returns False) and so does this."""
        if self.sched.has_work:
            return
        pool = BlockPool(self.sched.pool.num_blocks)
        pool.on_evict = self._on_evict
        self.sched.pool = pool
        self._emit([self.events.cleared()])

    async def close(self) -> None:
        if self._driver is not None:
            self._driver.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._driver
            self._driver = None

    # -- events (called by the scheduler and the pool) -----------------------------

    def _on_cache(self, seq: Seq, first: int, end: int) -> None:
        src = self._kv_src.get(seq.rid)
        if src is None:
            return
        keys = list(seq.prompt_keys[:end])
        self._pending.append(self._stored_event(src[0], keys, src[1], first))

    def _on_evict(self, key: int) -> None:
        if key >= 0:  # engine hashes; negative keys are the scheduler's own (never here)
            self._pending.append(self.events.removed(wire_hash(key, self.settings.int_hashes)))

    def _flush(self) -> None:
        events, self._pending = self._pending, []
        self._emit(events)

    # -- requests ------------------------------------------------------------------

    async def generate(self, req: SimRequest) -> AsyncGenerator[int, None]:
        loop = asyncio.get_running_loop()
        rid = next(self._ids)
        outputs = [output_token(req.prompt_ids, i) for i in range(req.max_tokens)]
        tokens = req.prompt_ids + outputs[:-1]
        keys = self.hasher.chain(
            tokens, lora=req.lora, cache_salt=req.cache_salt, prefix=req.block_hashes
        )
        seq = Seq(rid, keys, len(req.prompt_ids), max_output=len(outputs))
        live = _Live(req, seq, tokens, outputs, loop.time())
        if self.spec.request_overhead_s > 0:  # the modelled API-server latency
            await self.sleep(self.spec.request_overhead_s)
        self._live[rid] = live
        self._kv_src[rid] = (req, tokens)
        self.sched.add(seq)
        self._counts()
        if self._driver is None:
            self._driver = asyncio.create_task(self._drive())
        try:
            for _ in outputs:
                tok = await live.queue.get()
                req.output_ids.append(tok)
                self.metrics.generation_tokens.inc()
                yield tok
            req.finish_reason = "length"
        finally:
            if not live.done:
                self._abort(seq)
            del self._live[rid]
            if live.scheduled_at is not None:
                reason = req.finish_reason or "abort"
                req.finish_reason = reason
                self.metrics.request_success[reason].inc()
                self.metrics.e2e_latency.observe(loop.time() - live.arrival)

    def _abort(self, seq: Seq) -> None:
        if self.sched.stepping:
            self._aborts.append(seq)  # after the step
        else:
            self.sched.abort(seq)
            self._kv_src.pop(seq.rid, None)
            self._counts()

    def _counts(self) -> None:
        self.waiting = len(self.sched.waiting)
        self.running = len(self.sched.running)

    # -- the engine loop -----------------------------------------------------------

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        sched, m = self.sched, self.metrics
        try:
            while sched.has_work:
                plan = sched.plan_step()
                assert plan is not None
                now = loop.time()
                for s, _ in plan.scheduled:
                    live = self._live.get(s.rid)
                    if live is not None and live.scheduled_at is None:
                        live.scheduled_at = now
                        req = live.req
                        req.queue_time = now - live.arrival
                        req.cached_tokens = max(0, s.hit_tokens)
                        m.queue_time.observe(req.queue_time)
                        m.prefix_cache_queries.inc(s.prompt_tokens)
                        m.prefix_cache_hits.inc(req.cached_tokens)
                        m.prompt_tokens.inc(s.prompt_tokens)
                self._flush()
                self._counts()
                before = {s.rid: s.num_output for s, _ in plan.scheduled}
                await self.sleep(plan.duration_s)
                result = sched.finish_step()
                now = loop.time()
                for s, _ in plan.scheduled:
                    live = self._live.get(s.rid)
                    if live is None or s.num_output <= before[s.rid]:
                        continue
                    if before[s.rid]:  # decoded: each token one step after the last
                        gap = plan.duration_s / plan.steps
                        for _ in range(s.num_output - before[s.rid]):
                            m.inter_token_latency.observe(gap)
                    for i in range(before[s.rid], min(s.num_output, len(live.outputs))):
                        live.queue.put_nowait(live.outputs[i])
                for s in result.first_tokens:
                    live = self._live.get(s.rid)
                    if live is not None and live.scheduled_at is not None:
                        live.first_at = now
                        live.req.ttft = now - live.arrival
                        m.time_to_first_token.observe(live.req.ttft)
                        m.prefill_time.observe(now - live.scheduled_at)
                for s in result.finished:
                    self._kv_src.pop(s.rid, None)
                    live = self._live.get(s.rid)
                    if live is not None:
                        live.done = True
                        if live.first_at is not None:
                            m.decode_time.observe(now - live.first_at)
                aborts, self._aborts = self._aborts, []
                for s in aborts:
                    sched.abort(s)
                    self._kv_src.pop(s.rid, None)
                self._flush()
                self._counts()
        finally:
            self._driver = None
