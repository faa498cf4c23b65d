"""Token ids -> a chain of block keys.

Key ``i`` is a 64-bit xxh3 hash of ``key[i-1]`` (8 bytes little-endian) followed by the
block's token ids (uint32 little-endian), so it depends on every token before it.
The chain starts at a *root* key derived from the model name; a LoRA adapter name
seeds every block's hash; a ``cache_salt`` is folded into block 0 only (as vLLM does).
Only full blocks are hashed: a trailing partial block is ignored.

These keys are ours: they never try to reproduce the engine's own block hash (whose
seed, algorithm and version differ across deployments).  KV events carry the token ids
of every stored block, so the indexer derives the same keys from them
(see :mod:`scoring.events`).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from functools import lru_cache

import xxhash

_h64 = xxhash.xxh3_64_intdigest
_MASK64 = (1 << 64) - 1


class BlockSizeError(ValueError):
    pass


@lru_cache(maxsize=4096)
def lora_seed(lora: str | None) -> int:
    """The xxh3 seed for every block of a request using ``lora`` (0 for the base model)."""
    if not lora:
        return 0
    return _h64(b"kvroute-lora\x00" + lora.encode())


@lru_cache(maxsize=1024)
def root_key(model: str, lora: str | None = None) -> int:
    """The chain's parent for block 0: depends on the model and the adapter."""
    return _h64(b"kvroute-root\x00" + model.encode(), lora_seed(lora))


def _salt_bytes(cache_salt: str | None) -> bytes:
    if not cache_salt:
        return b""
    return _h64(b"kvroute-salt\x00" + cache_salt.encode()).to_bytes(8, "little")


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    try:
        return array("I", token_ids).tobytes()
    except (OverflowError, TypeError) as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None


def chain_keys(
    token_ids: Sequence[int],
    block_size: int,
    *,
    parent: int,
    lora: str | None = None,
    cache_salt: str | None = None,
) -> list[int]:
    """Keys of the full blocks of ``token_ids`` chained after ``parent``.

    ``cache_salt`` applies to the first block of this call: pass it only when the
    chain starts at token 0 (``parent`` is the root key).
    """
    if block_size <= 0:
        raise BlockSizeError(f"block_size must be positive, got {block_size}")
    buf = _token_bytes(token_ids)
    step = block_size * 4
    end = (len(token_ids) // block_size) * step
    seed = lora_seed(lora)
    out: list[int] = []
    if end == 0:
        return out
    append = out.append
    p = parent
    salt = _salt_bytes(cache_salt)
    p = _h64(p.to_bytes(8, "little") + salt + buf[0:step], seed)
    append(p)
    for off in range(step, end, step):
        p = _h64(p.to_bytes(8, "little") + buf[off : off + step], seed)
        append(p)
    return out


class BlockHasher:
    """Hashes prompts for one model and block size."""

    __slots__ = ("block_size", "model")

    def __init__(self, block_size: int, model: str = "") -> None:
        if block_size <= 0:
            raise BlockSizeError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.model = model

    def root(self, lora: str | None = None) -> int:
        return root_key(self.model, lora)

    def keys(
        self,
        token_ids: Sequence[int],
        *,
        lora: str | None = None,
        cache_salt: str | None = None,
    ) -> list[int]:
        """The key chain of a whole prompt (starting at token 0)."""
        if len(token_ids) < self.block_size:
            return []  # no full block: nothing to hash
        return chain_keys(
            token_ids,
            self.block_size,
            parent=root_key(self.model, lora),
            lora=lora,
            cache_salt=cache_salt,
        )

    def extend(
        self,
        keys: list[int],
        token_ids: Sequence[int],
        *,
        lora: str | None = None,
        cache_salt: str | None = None,
    ) -> list[int]:
        """Keys for ``token_ids`` given the keys already computed for a prefix of them.

        ``token_ids[: len(keys) * block_size]`` must be the prefix that produced ``keys``
        (multi-turn chats: the new turn only hashes the blocks it adds).  ``cache_salt``
        only matters when ``keys`` is empty (it lives in block 0).
        """
        done = len(keys) * self.block_size
        if not keys:
            return self.keys(token_ids, lora=lora, cache_salt=cache_salt)
        return keys + chain_keys(token_ids[done:], self.block_size, parent=keys[-1], lora=lora)
