"""The simulated engine's own block hash, shaped like vLLM's.

``digest_i = sha256(parent_digest || tokens_i as uint32 LE || extra_i)`` with
``parent_digest`` of block 0 = ``NONE_HASH = sha256(hash_seed)``, so a block's hash
depends on every token before it.  ``extra_i`` is the *tagged* extra keys, as vLLM
hashes them: ``("lora", name)`` on every block of a LoRA request and
``("cache_salt", salt)`` on block 0 only.  Only full blocks are hashed.

A digest is kept as a Python int (``int.from_bytes(digest, "big")``).  What goes on
the wire is what vLLM publishes: the low 64 bits (vLLM's
``int.from_bytes(digest, "big") & (2**64 - 1)``) or, with int hashes off, the raw
32-byte digest.  The encoding deliberately differs from :mod:`scoring.blocks`: the
router must learn our blocks from the ``token_ids`` in the events, never by
re-deriving the engine's hash.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

_MASK64 = (1 << 64) - 1
DIGEST_BYTES = 32


def _extra_bytes(lora: str | None, salt: str | None) -> bytes:
    out = b""
    if lora:
        out += b"\x01lora\x00" + lora.encode() + b"\x00"
    if salt:
        out += b"\x02cache_salt\x00" + salt.encode() + b"\x00"
    return out


class EngineHasher:
    """Chained sha256 block hashes for one pod."""

    __slots__ = ("_none", "block_size")

    def __init__(self, block_size: int, seed: str = "vllm-none-hash") -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self._none = hashlib.sha256(seed.encode()).digest()

    def chain(
        self,
        token_ids: Sequence[int],
        *,
        lora: str | None = None,
        cache_salt: str | None = None,
        prefix: Sequence[int] = (),
    ) -> list[int]:
        """Hashes of the full blocks of ``token_ids`` (from token 0).

        ``prefix`` = hashes already computed for the leading blocks of the same
        tokens (a request's prompt, when hashing prompt + output): they are reused.
        """
        bs = self.block_size
        n_full = len(token_ids) // bs
        out = list(prefix[:n_full])
        parent = out[-1].to_bytes(DIGEST_BYTES, "big") if out else self._none
        for i in range(len(out), n_full):
            try:
                toks = array("I", token_ids[i * bs : (i + 1) * bs]).tobytes()
            except (OverflowError, TypeError) as exc:
                raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None
            extra = _extra_bytes(lora, cache_salt if i == 0 else None)
            parent = hashlib.sha256(parent + toks + extra).digest()
            out.append(int.from_bytes(parent, "big"))
        return out


def wire_hash(key: int, int_hashes: bool) -> int | bytes:
    """The form vLLM publishes: low 64 bits as an int, or the 32-byte digest."""
    if int_hashes:
        return key & _MASK64
    return key.to_bytes(DIGEST_BYTES, "big")
