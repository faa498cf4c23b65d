"""Hit-rate ceilings no routing policy can beat (timing ignored: a request's blocks are
available to the very next arrival).

* ``infinite`` — one cache of unlimited size shared by the fleet: a request reuses its
  longest prefix that any earlier request had.
* ``pooled`` — one LRU :class:`~scoring.simcache.PrefixCache` of ``N x T`` tokens fed the
  whole trace in arrival order (what a perfectly shared fleet cache would keep).

Both count hit tokens as ``min(matched_blocks * block_size, prompt_tokens)`` over the sum
of prompt tokens.
"""

from __future__ import annotations

from scoring.replay.trace import Trace
from scoring.simcache import PrefixCache


def infinite_ceiling(trace: Trace) -> float:
    seen: set[int] = set()
    hit = total = 0
    bs = trace.block_size
    for r in trace.requests:
        keys = r.route.block_keys
        n = 0
        for k in keys:
            if k not in seen:
                break
            n += 1
        hit += min(n * bs, r.prompt_tokens)
        total += r.prompt_tokens
        seen.update(keys)
    return hit / total if total else 0.0


def pooled_ceiling(trace: Trace, capacity_tokens: int) -> float:
    cache = PrefixCache(capacity_tokens // trace.block_size)
    hit = total = 0
    bs = trace.block_size
    for r in trace.requests:
        keys = r.route.block_keys
        hit += min(cache.match(keys) * bs, r.prompt_tokens)
        total += r.prompt_tokens
        cache.insert(keys)
    return hit / total if total else 0.0
