"""What operators should measure about a workload before adopting a routing policy.

* ``prompt_tokens`` — distribution of prompt lengths (mean, p10, p50, p90, p99, max).
* ``user_turns_per_request`` — user turns in a request's history (mean, p50, max), only
  when the trace says (OpenAI bodies); ``None`` for Mooncake.
* ``turns_per_conversation`` — user turns of each conversation (its longest request),
  with ``conversations``, when requests carry session ids; else ``None``.
* ``prefix_share_rate`` — share of requests whose first block was already seen in an
  earlier request (some reuse is possible at all).
* ``prefix_breakers`` — share of requests whose first block appears in no other request
  of the trace (a timestamp or id at the very start of the prompt defeats every prefix
  cache); requests shorter than one block are counted as ``no_full_block``.
* ``reuse_ceiling`` — the infinite-cache token hit rate (see :mod:`.ceilings`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

from scoring.replay.ceilings import infinite_ceiling
from scoring.replay.trace import Trace


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, ``q`` in [0, 100] (0.0 for no values)."""
    if not values:
        return 0.0
    xs = sorted(values)
    rank = max(1, -(-len(xs) * q // 100))
    return float(xs[int(min(rank, len(xs))) - 1])


def workload_stats(trace: Trace) -> dict[str, Any]:
    reqs = trace.requests
    n = len(reqs)
    prompts = [r.prompt_tokens for r in reqs]
    first = Counter(r.route.block_keys[0] for r in reqs if r.route.block_keys)
    seen: set[int] = set()
    shared = 0
    for r in reqs:
        if r.route.block_keys:
            k = r.route.block_keys[0]
            shared += k in seen
            seen.add(k)
    no_block = sum(1 for r in reqs if not r.route.block_keys)
    breakers = sum(1 for r in reqs if r.route.block_keys and first[r.route.block_keys[0]] == 1)
    turns = [r.turns for r in reqs if r.turns is not None]
    # a conversation's length = the most user turns any of its requests carries
    per_session: dict[str, int] = {}
    for r in reqs:
        if r.turns is not None and r.route.session is not None:
            per_session[r.route.session] = max(per_session.get(r.route.session, 0), r.turns)
    conv = list(per_session.values())
    span = (reqs[-1].arrival_s - reqs[0].arrival_s) if n > 1 else 0.0
    return {
        "requests": n,
        "duration_s": span,
        "arrival_rate_rps": n / span if span > 0 else None,
        "prompt_tokens": {
            "mean": sum(prompts) / n if n else 0.0,
            "p10": percentile(prompts, 10),
            "p50": percentile(prompts, 50),
            "p90": percentile(prompts, 90),
            "p99": percentile(prompts, 99),
            "max": max(prompts, default=0),
        },
        "output_tokens_mean": sum(r.output_tokens for r in reqs) / n if n else 0.0,
        "user_turns_per_request": _spread(turns),
        "turns_per_conversation": _spread(conv),
        "conversations": len(conv) if conv else None,
        "prefix_share_rate": shared / n if n else 0.0,
        "prefix_breakers": breakers / n if n else 0.0,
        "no_full_block": no_block / n if n else 0.0,
        "reuse_ceiling": infinite_ceiling(trace),
    }


def _spread(values: Sequence[int]) -> dict[str, float] | None:
    if not values:
        return None
    return {"mean": sum(values) / len(values), "p50": percentile(values, 50), "max": max(values)}
