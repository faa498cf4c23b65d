"""The simulated pod's embedding: a deterministic unit vector per input."""

from __future__ import annotations

import hashlib
import json
import math


def embedding_vector(ids: list[int], dim: int) -> list[float]:
    """A unit vector of ``dim`` floats from sha256 of the token ids: same input, same
    vector."""
    seed = hashlib.sha256(json.dumps(ids).encode()).digest()
    raw: list[float] = []
    counter = 0
    while len(raw) < dim:
        block = hashlib.sha256(seed + counter.to_bytes(4, "big")).digest()
        raw += [(b - 127.5) / 127.5 for b in block]
        counter += 1
    raw = raw[:dim]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [x / norm for x in raw]
