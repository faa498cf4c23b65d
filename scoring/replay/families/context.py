"""Prompts as chains of segments, hashed into block keys exactly as a prefix cache sees them.

A synthetic prompt is a list of *segments*: runs of tokens no other segment contains (a
system prompt, a document, one user message, one tool result), each named by an id.
Two prompts share their first ``n`` tokens exactly when their segment lists agree that
far, so block ``i`` (tokens ``[i*b, (i+1)*b)``) is keyed by its parent's key and the
pieces ``(segment id, offset, length)`` it covers::

    key_i = xxh3_64(key_{i-1} || seg || off || len || seg' || off' || len' ...)

A key therefore names a whole prefix, as vLLM's block hashes and our token block keys do,
and only full blocks get a key (a trailing partial block is never cached).  A segment
shared by many prompts (a system prompt) gives them the same leading keys; the block
that straddles it and the next, unique, segment is unique.
"""

from __future__ import annotations

import math
import random
import struct
from dataclasses import dataclass, field

import xxhash

from scoring.blocks import root_key

_h64 = xxhash.xxh3_64_intdigest
_piece = struct.Struct("<QQQ").pack
_parent = struct.Struct("<Q").pack


class SegmentIds:
    """Mints segment ids unique within one generated trace."""

    __slots__ = ("_next",)

    def __init__(self) -> None:
        self._next = 0

    def new(self) -> int:
        self._next += 1
        return self._next


@dataclass
class Context:
    """A growing prompt: its segments' block keys and token count.

    ``append`` extends the chain in place (only the new full blocks are hashed);
    :meth:`snapshot` returns the keys of the prompt as it stands.
    """

    block_size: int
    model: str = "synthetic"
    tokens: int = 0
    keys: list[int] = field(default_factory=list)
    #: pieces of the partial block at the end, not yet keyed
    _tail: list[tuple[int, int, int]] = field(default_factory=list)
    _tail_tokens: int = 0

    def append(self, segment: int, length: int) -> Context:
        """Append ``length`` tokens of segment ``segment`` (never seen before in this
        context: a segment is appended once)."""
        if length < 0:
            raise ValueError(f"segment length must be >= 0, got {length}")
        bs = self.block_size
        off = 0
        while off < length:
            take = min(length - off, bs - self._tail_tokens)
            self._tail.append((segment, off, take))
            self._tail_tokens += take
            off += take
            if self._tail_tokens == bs:
                parent = self.keys[-1] if self.keys else root_key(self.model)
                data = _parent(parent) + b"".join(_piece(*p) for p in self._tail)
                self.keys.append(_h64(data))
                self._tail.clear()
                self._tail_tokens = 0
        self.tokens += length
        return self

    def snapshot(self) -> tuple[int, list[int]]:
        """``(prompt_tokens, block_keys)`` of the prompt as it stands."""
        return self.tokens, list(self.keys)

    def copy(self) -> Context:
        """An independent context with the same prefix (to branch off a shared one)."""
        return Context(
            block_size=self.block_size,
            model=self.model,
            tokens=self.tokens,
            keys=list(self.keys),
            _tail=list(self._tail),
            _tail_tokens=self._tail_tokens,
        )


def lognormal_int(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    """A log-normal draw with the given median (``exp(mu)``) and shape, rounded and
    clipped to ``[lo, hi]``; ``sigma == 0`` gives the median."""
    x = median * math.exp(rng.gauss(0.0, sigma)) if sigma > 0 else median
    return int(min(hi, max(lo, round(x))))


def lognormal_s(rng: random.Random, median: float, sigma: float) -> float:
    """A log-normal duration (seconds) with the given median."""
    return median * math.exp(rng.gauss(0.0, sigma)) if sigma > 0 else median


def zipf_weights(n: int, s: float) -> list[float]:
    """Popularity weights ``1 / rank**s`` of ``n`` items (``s = 0``: uniform)."""
    return [1.0 / (r**s) for r in range(1, n + 1)]
