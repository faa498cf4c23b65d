"""The simulated engine's own block hash, shaped like vLLM's.

Two algorithms (``SimSettings.hash_algo``):

* ``"sim"`` (default): ``digest_i = sha256(parent_digest || tokens_i as uint32 LE ||
  extra_i)``, ``parent_digest`` of block 0 = ``sha256(hash_seed)``.  Shaped like vLLM's
  but deliberately *not* reproducible by anyone else: the router must learn our blocks
  from the ``token_ids`` in the events, never by re-deriving the engine's hash.
* ``"sha256"``: exactly vLLM's ``sha256`` prefix-caching hash
  (``vllm/v1/core/kv_cache_utils.py`` ``hash_block_tokens``,
  ``vllm/utils/hashing.py``): ``digest_i = sha256(pickle.dumps((parent_digest or
  NONE_HASH, tuple(tokens_i), extra_i), HIGHEST_PROTOCOL))`` with
  ``NONE_HASH = sha256(pickle.dumps(hash_seed))`` — for testing an engine-hash mode
  against simulated pods.

``extra_i`` is the *tagged* extra keys, as vLLM hashes them: ``("lora", name, path)``
on every block of a LoRA request and ``("cache_salt", salt)`` on block 0 only
(``None`` when there are none).  Only full blocks are hashed.

A digest is kept as a Python int (``int.from_bytes(digest, "big")``).  What goes on the
wire is what vLLM publishes: the low 64 bits (vLLM's
``int.from_bytes(digest, "big") & (2**64 - 1)``) or, with int hashes off, the raw
32-byte digest.
"""

from __future__ import annotations

import hashlib
import pickle
from array import array
from collections.abc import Sequence
from typing import Any

_MASK64 = (1 << 64) - 1
DIGEST_BYTES = 32
HASH_ALGOS = ("sim", "sha256")


def lora_path(name: str) -> str:
    """The (fictional) adapter path of a simulated LoRA adapter; /v1/models shows it
    as the adapter's ``root``, as vLLM does."""
    return f"/sim/lora/{name}"


def _pickle_sha256(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


class EngineHasher:
    """Chained sha256 block hashes for one pod."""

    __slots__ = ("_none", "algo", "block_size")

    def __init__(self, block_size: int, seed: str = "vllm-none-hash", algo: str = "sim") -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if algo not in HASH_ALGOS:
            raise ValueError(f"hash algorithm must be one of {HASH_ALGOS}, got {algo!r}")
        self.block_size = block_size
        self.algo = algo
        self._none = (
            hashlib.sha256(seed.encode()).digest() if algo == "sim" else _pickle_sha256(seed)
        )

    def _block(
        self, parent: bytes, tokens: Sequence[int], lora: str | None, salt: str | None
    ) -> bytes:
        if self.algo == "sha256":
            keys: tuple[Any, ...] = ()
            if lora:
                keys += (("lora", lora, lora_path(lora)),)
            if salt:
                keys += (("cache_salt", salt),)
            return _pickle_sha256((parent, tuple(tokens), keys or None))
        try:
            toks = array("I", tokens).tobytes()
        except (OverflowError, TypeError) as exc:
            raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None
        extra = b""
        if lora:
            extra += b"\x01lora\x00" + lora.encode() + b"\x00"
        if salt:
            extra += b"\x02cache_salt\x00" + salt.encode() + b"\x00"
        return hashlib.sha256(parent + toks + extra).digest()

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
            block = token_ids[i * bs : (i + 1) * bs]
            parent = self._block(parent, block, lora, cache_salt if i == 0 else None)
            out.append(int.from_bytes(parent, "big"))
        return out


def wire_hash(key: int, int_hashes: bool) -> int | bytes:
    """The form vLLM publishes: low 64 bits as an int, or the 32-byte digest."""
    if int_hashes:
        return key & _MASK64
    return key.to_bytes(DIGEST_BYTES, "big")
