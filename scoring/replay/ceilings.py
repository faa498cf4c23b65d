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

from collections.abc import Iterable, Iterator

from scoring.replay.trace import Trace
from scoring.simcache import PrefixCache


def infinite_ceiling(trace: Trace) -> float:
    return _share(prefill_at_ceiling(trace, None))


def pooled_ceiling(trace: Trace, capacity_tokens: int) -> float:
    return _share(prefill_at_ceiling(trace, capacity_tokens))


def prefill_at_ceiling(trace: Trace, capacity_tokens: int | None) -> Iterator[tuple[int, int]]:
    """Each request's ``(prompt tokens, cached tokens)`` at a ceiling: the pooled cache of
    ``capacity_tokens`` (``None``: the infinite one).  A request's answer blocks, when a
    later prompt carries them (``TraceRequest.answer_keys``), are cached with it."""
    bs = trace.block_size
    if capacity_tokens is None:
        seen: set[int] = set()
        for r in trace.requests:
            keys = r.route.block_keys
            n = 0
            for k in keys:
                if k not in seen:
                    break
                n += 1
            yield r.prompt_tokens, min(n * bs, r.prompt_tokens)
            seen.update(r.cached_keys() if r.answer_keys else keys)
        return
    cache = PrefixCache(capacity_tokens // bs)
    for r in trace.requests:
        keys = r.route.block_keys
        yield r.prompt_tokens, min(cache.match(keys) * bs, r.prompt_tokens)
        cache.insert(r.cached_keys() if r.answer_keys else keys)


def _share(prefills: Iterable[tuple[int, int]]) -> float:
    hit = total = 0
    for prompt, cached in prefills:
        hit += cached
        total += prompt
    return hit / total if total else 0.0
