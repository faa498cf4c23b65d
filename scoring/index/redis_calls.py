"""How :class:`~scoring.index.redis.RedisIndex` sends its Lua scripts: block keys packed as
8 big-endian bytes each (:func:`pack_keys`), and a batch of script calls run in one
round trip, scripts the server lost loaded again (:func:`run_calls`)."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

__all__ = ["Call", "pack_keys", "run_calls"]

_U64 = (1 << 64) - 1


def pack_keys(keys: Sequence[int]) -> bytes:
    """Block keys -> 8 big-endian bytes each; ValueError naming the bad key otherwise."""
    try:
        return struct.pack(f">{len(keys)}Q", *keys)
    except (struct.error, TypeError):
        for i, k in enumerate(keys):
            if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= _U64:
                raise ValueError(
                    f"block key #{i} must be an unsigned 64-bit int, got {k!r}"
                ) from None
        raise


#: one script call: (script, KEYS, ARGV)
Call = tuple[AsyncScript, list[bytes], list[Any]]


async def run_calls(client: aioredis.Redis, calls: list[Call]) -> None:
    """Run script calls in order: one call, or one pipeline (still one round trip).

    A call refused with NOSCRIPT (the server restarted or flushed its script cache)
    is retried, in order, after SCRIPT LOAD; calls that ran are never re-run.
    """
    if len(calls) == 1:
        script, keys, args = calls[0]
        await script(keys=keys, args=args)
        return
    todo = calls
    for _attempt in range(2):
        async with client.pipeline(transaction=False) as pipe:
            for script, keys, args in todo:
                pipe.evalsha(script.sha, len(keys), *keys, *args)
            results = await pipe.execute(raise_on_error=False)
        errors = [r for r in results if isinstance(r, Exception)]
        if not errors:
            return
        other = [e for e in errors if not isinstance(e, NoScriptError)]
        if other:
            raise other[0]
        failed = [c for c, r in zip(todo, results, strict=True) if isinstance(r, Exception)]
        for script in {id(c[0]): c[0] for c in failed}.values():
            await client.script_load(script.script)
        todo = failed
    raise RuntimeError("script missing on the server even after SCRIPT LOAD")
