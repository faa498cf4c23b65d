"""vLLM V1's scheduler, one engine step at a time, with no clock inside.

A pure step function over a :class:`~scoring.replay.kv_blocks.BlockPool`: the driver
calls :meth:`Scheduler.plan_step` (which schedules as vLLM's ``Scheduler.schedule()``
does and returns how long the step takes), lets that time pass (virtual in the
replay, real in a simulated server), then calls :meth:`Scheduler.finish_step` (tokens
sampled, first tokens, finished requests freed).  Requests arriving meanwhile are
:meth:`Scheduler.add`\\ ed and considered at the next step.

Each step, as ``vllm/v1/core/sched/scheduler.py`` (FCFS policy, synchronous):

1. **Running requests first**, in order, each given ``min(tokens left to compute,
   budget left)`` tokens of the ``max_num_batched_tokens`` budget: a decode takes 1, a
   request still prefilling takes its next chunk.  Its new blocks come from the pool;
   if the pool is short, the *last* running request is preempted (recompute: its
   blocks freed, back to the front of the waiting queue) until it fits — or, when the
   one preempted is the request itself, scheduling of running requests stops.
2. **Then waiting requests**, FCFS, unless a request was preempted this step: the head
   is looked up in the prefix cache *now* (not at arrival) — the longest cached chain
   of its full blocks, at most ``(tokens - 1) // block_size`` blocks so the last token
   is always computed — then given ``min(tokens left, budget left)`` tokens.  It waits
   (and so does everyone behind it) when ``max_num_seqs`` requests run, the budget is
   spent, or the pool cannot supply its blocks (cache hits that sit in the free queue
   count against the free blocks, since taking them removes them from it).
3. Full blocks of the tokens scheduled are cached as soon as they are allocated, prompt
   and generated tokens alike (a finished request's cached tokens are prompt +
   output[:-1]); a generated block's key is unique to its request.
4. At the end of the step every request that has computed all its tokens samples one:
   a request's first sampled token is its first token; a request with ``max_output``
   tokens finishes and frees its blocks tail first.

**Stepping over decode runs.**  When a step is decode only — every running request
decodes, none was preempted, and the waiting queue is empty or its head waits for
``max_num_seqs`` or for budget — the steps after it are identical until a request
finishes or the pool runs short, except that each attends one more token per request.
:meth:`plan_step` then covers up to ``max_span_s`` of such steps in one plan (their
blocks allocated and cached at once, their time summed in closed form) and returns
``steps > 1``.  The state after the run is the state after stepping one by one
(``fast_forward=False``); only its intermediate states are not observable.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from scoring.replay.kv_blocks import BlockPool
from scoring.replay.step_cost import StepCost, StepWork, prefill_pairs

_NOT_BLOCKED, _BY_SEQS, _BY_BUDGET, _BY_KV = 0, 1, 2, 3


@dataclass(slots=True, eq=False)
class Seq:
    """One request inside the engine."""

    rid: int
    #: keys of the request's full blocks that have one: the prompt's (replay), or the
    #: prompt's and its known output's (a simulated server, whose output is fixed)
    prompt_keys: Sequence[int]
    prompt_tokens: int
    max_output: int  # >= 1
    num_computed: int = 0
    num_output: int = 0
    blocks: list[int] = field(default_factory=list)
    num_cached_blocks: int = 0
    hit_tokens: int = -1  # prefix-cache hit when first scheduled (-1: not yet)
    preemptions: int = 0

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.num_output

    def key(self, i: int) -> int:
        """Block ``i``'s key: the trace's for a prompt block, else unique to this request."""
        if i < len(self.prompt_keys):
            return self.prompt_keys[i]
        return -((self.rid << 32) | i) - 1

    def keys(self, n: int) -> Iterator[int]:
        """The keys of blocks ``0 .. n-1``."""
        p = len(self.prompt_keys)
        if n <= p:
            return iter(self.prompt_keys[:n])
        return itertools.chain(self.prompt_keys, (self.key(i) for i in range(p, n)))


@dataclass(slots=True)
class StepPlan:
    """What one planned step (or run of ``steps`` decode steps) computes."""

    duration_s: float
    steps: int
    work: StepWork  # of the first step
    scheduled: list[tuple[Seq, int]]  # (request, tokens) of the first step
    preempted: list[Seq]


@dataclass(slots=True)
class StepResult:
    first_tokens: list[Seq]
    finished: list[Seq]


class Scheduler:
    """vLLM's continuous-batching scheduler over one KV block pool."""

    def __init__(
        self,
        cost: StepCost,
        *,
        num_blocks: int,
        block_size: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        fast_forward: bool = True,
    ) -> None:
        self.pool = BlockPool(num_blocks)
        self.cost = cost
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.fast_forward = fast_forward
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.steps = 0
        self.preemptions = 0
        self._plan: StepPlan | None = None
        #: called as ``on_cache(seq, first, end)`` when blocks ``first .. end-1`` of
        #: ``seq`` become full and cached (a simulated server publishes BlockStored)
        self.on_cache: Callable[[Seq, int, int], None] | None = None

    @property
    def stepping(self) -> bool:
        """A planned step has not finished yet."""
        return self._plan is not None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Seq) -> None:
        self.waiting.append(seq)

    def abort(self, seq: Seq) -> None:
        """Drop ``seq`` (a client went away), as vLLM's ``finish_requests`` does: it
        leaves the queues and frees its blocks (their cached prefixes stay, free).
        Not while a step is planned: the step's results would name it."""
        if self._plan is not None:
            raise RuntimeError("abort called while a step is planned")
        if seq in self.running:
            self.running.remove(seq)
            self.pool.free(reversed(seq.blocks))
            seq.blocks = []
        elif seq in self.waiting:
            self.waiting.remove(seq)

    # --- one step -------------------------------------------------------------------

    def plan_step(self, max_span_s: float = math.inf) -> StepPlan | None:
        """Schedule the next step (or decode run of at most ``max_span_s``); ``None``
        when there is nothing to run."""
        if self._plan is not None:
            raise RuntimeError("plan_step called before the planned step finished")
        if not self.has_work:
            return None
        pool, bs = self.pool, self.block_size
        running = self.running
        budget = self.max_num_batched_tokens
        work = _Work()
        scheduled: list[tuple[Seq, int]] = []
        preempted: list[Seq] = []
        i = 0
        while i < len(running) and budget > 0:
            s = running[i]
            n = min(s.num_tokens - s.num_computed, budget)
            need = -(-(s.num_computed + n) // bs) - len(s.blocks)
            stalled = False
            while need > pool.num_free:
                victim = running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is s:
                    stalled = True
                    break
            if stalled:
                break
            if need > 0:
                s.blocks.extend(pool.allocate(need))
            self._run(s, n, work, scheduled)
            budget -= n
            i += 1
        blocked = _NOT_BLOCKED
        if not preempted:
            blocked = self._admit_waiting(budget, work, scheduled)
        if not scheduled:
            raise RuntimeError("the engine scheduled nothing although requests are waiting")
        step_work = work.freeze()
        plan = StepPlan(self.cost.seconds(step_work), 1, step_work, scheduled, preempted)
        if (
            self.fast_forward
            and not preempted
            and blocked in (_NOT_BLOCKED, _BY_SEQS, _BY_BUDGET)
            and step_work.prefill_tokens == 0
            and len(scheduled) == len(running)
        ):
            self._extend_decode_run(plan, max_span_s)
        self._plan = plan
        self.steps += plan.steps
        return plan

    def finish_step(self) -> StepResult:
        """The planned step ends: sample tokens, report first tokens and finished ones."""
        plan = self._plan
        if plan is None:
            raise RuntimeError("finish_step called with no planned step")
        self._plan = None
        first: list[Seq] = []
        finished: list[Seq] = []
        if plan.steps > 1:
            for s, _ in plan.scheduled:
                s.num_output += plan.steps
                if s.num_output >= s.max_output:
                    finished.append(s)
        else:
            for s, _ in plan.scheduled:
                if s.num_computed == s.num_tokens:
                    s.num_output += 1
                    if s.num_output == 1:
                        first.append(s)
                    if s.num_output >= s.max_output:
                        finished.append(s)
        if finished:
            done = set(finished)
            self.running = [s for s in self.running if s not in done]
            for s in finished:
                self.pool.free(reversed(s.blocks))
                s.blocks = []
        return StepResult(first, finished)

    # --- helpers --------------------------------------------------------------------

    def _admit_waiting(self, budget: int, work: _Work, scheduled: list[tuple[Seq, int]]) -> int:
        pool, bs, waiting = self.pool, self.block_size, self.waiting
        while waiting:
            if budget <= 0:
                return _BY_BUDGET
            if len(self.running) >= self.max_num_seqs:
                return _BY_SEQS
            s = waiting[0]
            hits = pool.match(s.keys((s.num_tokens - 1) // bs))
            hit_tokens = len(hits) * bs
            n = min(s.num_tokens - hit_tokens, budget)
            need = -(-(hit_tokens + n) // bs) - len(hits)
            evictable = sum(1 for b in hits if pool.is_free(b))
            if need + evictable > pool.num_free:
                return _BY_KV
            waiting.popleft()
            pool.touch(hits)
            s.blocks = hits + pool.allocate(need) if need > 0 else hits
            s.num_computed = hit_tokens
            s.num_cached_blocks = len(hits)
            if s.hit_tokens < 0:
                s.hit_tokens = hit_tokens
            self.running.append(s)
            self._run(s, n, work, scheduled)
            budget -= n
        return _NOT_BLOCKED

    def _run(self, s: Seq, n: int, work: _Work, scheduled: list[tuple[Seq, int]]) -> None:
        """Schedule ``n`` tokens of ``s`` (its blocks are allocated): count the work,
        advance its computed tokens, cache its newly full blocks."""
        before = s.num_computed
        if n == 1 and s.num_output > 0 and before == s.num_tokens - 1:
            work.decode_seqs += 1
            work.decode_context += before + 1
        else:
            work.prefill_tokens += n
            work.prefill_pairs += prefill_pairs(before, n)
        s.num_computed = before + n
        self._cache_full_blocks(s)
        scheduled.append((s, n))

    def _cache_full_blocks(self, s: Seq) -> None:
        full = s.num_computed // self.block_size
        first = s.num_cached_blocks
        if full <= first:
            return
        cache, blocks = self.pool.cache, s.blocks
        for j in range(first, full):
            cache(blocks[j], s.key(j))
        s.num_cached_blocks = full
        if self.on_cache is not None:
            self.on_cache(s, first, full)

    def _preempt(self, s: Seq) -> None:
        self.pool.free(reversed(s.blocks))
        s.blocks = []
        s.num_computed = 0
        s.num_cached_blocks = 0
        s.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(s)

    def _extend_decode_run(self, plan: StepPlan, max_span_s: float) -> None:
        """Stretch a decode-only first step into a run of identical decode steps."""
        seqs = [s for s, _ in plan.scheduled]
        cap = min(s.max_output - s.num_output for s in seqs)  # the first step samples 1
        bs, free = self.block_size, self.pool.num_free

        def extra_blocks(k: int) -> int:  # blocks steps 2..k need beyond those held
            return sum(max(0, -(-(s.num_computed + k - 1) // bs) - len(s.blocks)) for s in seqs)

        if cap > 1 and extra_blocks(cap) > free:
            lo, hi = 1, cap  # extra(lo) <= free < extra(hi)
            while hi - lo > 1:
                mid = (lo + hi) // 2
                if extra_blocks(mid) <= free:
                    lo = mid
                else:
                    hi = mid
            cap = lo
        n, context = plan.work.decode_seqs, plan.work.decode_context
        k = max(1, self.cost.decode_steps_within(n, context, max_span_s, cap))
        if k == 1:
            return
        for s in seqs:
            need = -(-(s.num_computed + k - 1) // bs) - len(s.blocks)
            if need > 0:
                s.blocks.extend(self.pool.allocate(need))
            s.num_computed += k - 1
            self._cache_full_blocks(s)
        plan.steps = k
        plan.duration_s = self.cost.decode_run_s(n, context, k)


@dataclass(slots=True)
class _Work:
    prefill_tokens: int = 0
    prefill_pairs: int = 0
    decode_seqs: int = 0
    decode_context: int = 0

    def freeze(self) -> StepWork:
        return StepWork(
            self.prefill_tokens, self.prefill_pairs, self.decode_seqs, self.decode_context
        )
