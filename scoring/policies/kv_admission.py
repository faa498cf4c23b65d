"""The wait for KV room: a request that a pod's free KV blocks cannot hold waits until
running requests finish and free theirs.

vLLM admits a waiting request only when the pool can supply the blocks of its next
chunk (``vllm/v1/core/sched/scheduler.py``; ``scoring/replay/vllm_sched.py``).  Blocks
held by running requests are not free; cached blocks no running request holds are (they
are evicted LRU).  vLLM reports the held share as ``kv_cache_usage_perc``
(``PodView.kv_usage``).  A hit takes its cached blocks out of the free pool too: vLLM
counts a computed block nobody holds as a block to allocate
(``get_num_blocks_to_allocate``'s evictable computed blocks), so a turn of a long
conversation whose previous turn has ended needs room for its whole context, not only
for its new tokens.  On a pod whose cache holds a few long prompts at a time, a
newcomer that does not fit waits for decodes, seconds, not for prefill::

    free     = capacity_blocks * (1 - kv_usage)
    need     = the request's blocks - held + waiting * unit     # the queue ahead first
    deficit  = need - free                                      # <= 0: no wait
    per_run  = capacity_blocks * kv_usage / running             # blocks a finish frees
    k        = ceil(deficit / per_run)                          # finishes needed
    wait     = decode_s * min(k, running + 1) / (running + 1)

``held`` is the leading blocks of the prompt that live requests routed to the pod and
admitted there carry (``cost``'s in-flight prefixes: held, so not taken from the pool
again; 0 with ``count_inflight_prefixes`` off).  vLLM allocates blocks at admission,
FCFS: a request past its first token is admitted, and of those not yet past it the pod's
scraped ``waiting`` are the newest, still unadmitted, holding nothing
(:meth:`scoring.policies.cost_ledger.CostLedger.held_by_admitted`;
``kv_held_admitted: false``: every live request holds).  ``unit`` the mean uncached
blocks of the requests the policy routes (its ``backlog_unit_tokens``), ``decode_s`` the
mean time from a request's first token to its end, learned from what the router sees
(:class:`DecodeTimes`; streamed requests only: a non-streamed answer has no first token
of its own), 0 until then.  The ``k``-th of
``running`` finishes spread over a decode time comes after about ``k / (running + 1)``
of it.  Without ``capacity_blocks``, ``kv_usage`` or a learned ``decode_s`` the wait
is 0.
"""

from __future__ import annotations

import math

from scoring.policies.base import PodView

#: the mean's memory: the last this many decode times weigh most
WINDOW = 256


class DecodeTimes:
    """The mean time from first token to end of the requests seen, recent ones weighted
    most (a running mean over the first :data:`WINDOW`, then an exponential one)."""

    __slots__ = ("mean_s", "rejected", "samples")

    def __init__(self) -> None:
        self.mean_s = 0.0
        self.samples = 0
        #: times dropped: a clock that went back, NaN or infinite (not a decode time)
        self.rejected = 0

    def add(self, seconds: float) -> None:
        if not 0.0 <= seconds < math.inf:
            self.rejected += 1
            return
        n = self.samples = self.samples + 1
        self.mean_s += (seconds - self.mean_s) / (n if n < WINDOW else WINDOW)


def admission_wait(view: PodView, need_blocks: float, decode_s: float) -> float:
    """Seconds ``view``'s pod keeps a request needing ``need_blocks`` (its own and the
    queue's ahead of it) waiting for KV room (the module docstring)."""
    cap, usage = view.capacity_blocks, view.kv_usage
    if not cap or usage is None or decode_s <= 0.0:
        return 0.0
    deficit = need_blocks - cap * (1.0 - usage)
    if deficit <= 0.0:
        return 0.0
    running = view.running or 0
    if running <= 0:
        return 0.0  # nothing to wait for: the pool is short of room for another reason
    per_run = cap * usage / running
    k = math.ceil(deficit / per_run) if per_run > 0 else running + 1
    return decode_s * min(k, running + 1) / (running + 1)
