"""Optional engine-hash mode: reproduce vLLM's own block hash, and prove it at runtime.

vLLM (``vllm/v1/core/kv_cache_utils.py`` ``hash_block_tokens``, ``vllm/utils/hashing.py``):

    digest_i = H((digest_{i-1} or NONE_HASH, tuple(tokens of block i), extra_keys_i))
    NONE_HASH = H(seed)

* ``H`` is ``sha256(pickle.dumps(x, HIGHEST_PROTOCOL))`` (``sha256``),
  ``sha256(cbor2.dumps(x, canonical=True))`` (``sha256_cbor``), or the same two
  serializations through ``xxh3_128`` (``xxhash``, ``xxhash_cbor``).
* ``seed`` is ``$PYTHONHASHSEED`` when the engine has it set; otherwise the fixed
  string ``"vllm-none-hash"`` for sha256/sha256_cbor, and a *random per-process* value
  for xxhash/xxhash_cbor (then no one can reproduce the hash: :class:`EngineHasher`
  refuses to build without an explicit seed for those).
* ``extra_keys_i`` is ``None`` or a tuple of tagged keys, in this order:
  ``("lora", name, path)`` on every block of a LoRA request, ``("mm", identifier,
  offset)`` pairs, ``("cache_salt", salt)`` on block 0 only, ``("prompt_embeds",
  digest)``.  Events publish them *untagged* (name, (identifier, offset), salt, digest),
  and without the LoRA path: LoRA blocks are verifiable only when ``lora_paths`` names
  the adapter's path.
* Published hash: with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`` (the default)
  ``int.from_bytes(digest, "big") & (2**64 - 1)`` -- the digest's last 8 bytes as a
  big-endian int; otherwise the raw digest bytes.  The form is taken from the events.

Our index keys never depend on this (see :mod:`scoring.blocks`).  The mode only helps to
*recover orphans*: the router calls :meth:`EngineHasher.learn` with the token chains of
requests it routes, so a ``BlockStored`` whose parent we never saw (missed event, late
join) can be linked when its parent's engine hash was learned.  It verifies itself: every
``BlockStored`` whose parent digest is known (always for chains starting at token 0) is
re-hashed and compared with the engine's hashes.  Matches and mismatches are counted; on
the first mismatch it logs an error naming the algorithm and seed, and disables itself
(no more learning, no more linking) -- a wrong seed must never pass silently.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import xxhash

from scoring.blocks import chain_keys, root_key
from scoring.events.decode import BlockStored, EngineHash

log = logging.getLogger(__name__)

ALGORITHMS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
DEFAULT_SEED = "vllm-none-hash"
_MASK64 = (1 << 64) - 1
_PICKLE = pickle.HIGHEST_PROTOCOL


def _serialize_pickle(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=_PICKLE)


def _serialize_cbor(obj: Any) -> bytes:
    import cbor2  # only needed for the *_cbor algorithms

    return bytes(cbor2.dumps(obj, canonical=True))


def _hash_fn(algo: str) -> Callable[[Any], bytes]:
    if algo not in ALGORITHMS:
        raise ValueError(f"unknown engine hash algorithm {algo!r}; expected one of {ALGORITHMS}")
    ser = _serialize_cbor if algo.endswith("_cbor") else _serialize_pickle
    if algo.startswith("sha256"):
        return lambda obj: hashlib.sha256(ser(obj)).digest()
    return lambda obj: xxhash.xxh3_128_digest(ser(obj))


class EngineHasher:
    """vLLM's block hash for one engine configuration (algorithm, seed)."""

    def __init__(
        self,
        algo: str = "sha256",
        seed: str | None = None,
        *,
        lora_paths: Mapping[str, str] | None = None,
        max_learned: int = 1_000_000,
        int_hashes: bool = True,
    ) -> None:
        self.algo = algo
        self._h = _hash_fn(algo)
        if seed is None:
            seed = os.environ.get("PYTHONHASHSEED")
        if seed is None:
            if algo.startswith("xxhash"):
                raise ValueError(
                    f"{algo}: vLLM seeds NONE_HASH with a random per-process value unless "
                    "PYTHONHASHSEED is set on the engine; pass that value as seed"
                )
            seed = DEFAULT_SEED
        self.seed = seed
        self.none_hash: bytes = self._h(seed)
        self.lora_paths = dict(lora_paths or {})
        self.max_learned = max_learned
        #: published hashes are ints (last 8 digest bytes; the engine's
        #: VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1 default) or raw digests; the events
        #: correct it (the form of the first verified BlockStored wins)
        self.int_hashes = int_hashes
        self.enabled = True
        self.matches = 0
        self.mismatches = 0
        self.unverifiable = 0
        #: (model, published hash) -> (our block key, parent's published hash or None)
        self._learned: dict[tuple[str, EngineHash], tuple[int, EngineHash | None]] = {}
        #: published hash -> full digest (to hash children of int-published parents)
        self._digests: dict[EngineHash, bytes] = {}
        #: our block key -> full digest (a new turn re-hashes only the blocks it adds)
        self._by_key: dict[int, bytes] = {}

    # -- hashing ---------------------------------------------------------------------

    def block_digest(
        self, parent: bytes | None, tokens: Sequence[int], extra_keys: tuple[Any, ...] | None
    ) -> bytes:
        """``hash_block_tokens``: the digest of one full block."""
        return self._h((parent or self.none_hash, tuple(tokens), extra_keys))

    def published(self, digest: bytes) -> EngineHash:
        """The hash as the engine publishes it in events."""
        return int.from_bytes(digest, "big") & _MASK64 if self.int_hashes else digest

    def chain(
        self,
        token_ids: Sequence[int],
        block_size: int,
        *,
        lora: str | None = None,
        cache_salt: str | None = None,
        parent: bytes | None = None,
    ) -> list[bytes]:
        """Digests of the full blocks of a request's tokens (from token 0 when
        ``parent`` is None).  LoRA requests need the adapter path in ``lora_paths``."""
        lora_key: tuple[Any, ...] = ()
        if lora:
            path = self.lora_paths.get(lora)
            if path is None:
                raise KeyError(f"no path known for LoRA adapter {lora!r} (lora_paths)")
            lora_key = (("lora", lora, path),)
        out: list[bytes] = []
        d = parent
        for i in range(len(token_ids) // block_size):
            salt: tuple[Any, ...] = (
                (("cache_salt", cache_salt),) if i == 0 and parent is None and cache_salt else ()
            )
            extra = (lora_key + salt) or None
            d = self.block_digest(d, token_ids[i * block_size : (i + 1) * block_size], extra)
            out.append(d)
        return out

    # -- learning from requests ------------------------------------------------------

    def learn(
        self,
        model: str,
        token_ids: Sequence[int],
        block_size: int,
        *,
        our_keys: Sequence[int] | None = None,
        lora: str | None = None,
        cache_salt: str | None = None,
    ) -> list[tuple[EngineHash, int]]:
        """Learn published hash -> our key for the blocks of one request.

        ``our_keys`` are the request's block keys at ``block_size`` (computed when
        omitted).  Blocks learned before (an earlier turn) are not hashed again.
        Returns the new (published hash, our key) pairs; nothing when disabled or
        when the LoRA adapter's path is unknown.
        """
        if not self.enabled or block_size <= 0:
            return []
        if lora and lora not in self.lora_paths:
            return []
        if our_keys is None:
            our_keys = chain_keys(
                token_ids,
                block_size,
                parent=root_key(model, lora),
                lora=lora,
                cache_salt=cache_salt,
            )
        n = min(len(our_keys), len(token_ids) // block_size)
        by_key = self._by_key
        start = 0
        while start < n and our_keys[start] in by_key:
            start += 1
        parent = by_key[our_keys[start - 1]] if start else None
        digests = self.chain(
            token_ids[start * block_size : n * block_size],
            block_size,
            lora=lora,
            cache_salt=cache_salt if start == 0 else None,
            parent=parent,
        )
        out: list[tuple[EngineHash, int]] = []
        prev: EngineHash | None = self.published(parent) if parent is not None else None
        for key, d in zip(our_keys[start:n], digests, strict=True):
            h = self.published(d)
            self._learned[(model, h)] = (key, prev)
            prev = h
            self._digests[h] = d
            by_key[key] = d
            out.append((h, key))
        self._bound()
        return out

    @property
    def learned_blocks(self) -> int:
        """Published hashes currently remembered from learned requests."""
        return len(self._learned)

    def resolve(self, model: str, engine_hash: EngineHash) -> int | None:
        """Our key for a published hash learned from a request of ``model``."""
        if not self.enabled:
            return None
        got = self._learned.get((model, engine_hash))
        return None if got is None else got[0]

    def ancestry(self, model: str, engine_hash: EngineHash) -> list[tuple[EngineHash, int]]:
        """The learned chain ending at ``engine_hash``: [(published hash, our key)] from
        the first block learned (block 0 unless evicted from the bounded memory)."""
        if not self.enabled:
            return []
        out: list[tuple[EngineHash, int]] = []
        h: EngineHash | None = engine_hash
        learned = self._learned
        while h is not None:
            got = learned.get((model, h))
            if got is None:
                break
            out.append((h, got[0]))
            h = got[1]
        out.reverse()
        return out

    def _bound(self) -> None:
        for d in (self._learned, self._digests, self._by_key):
            over = len(d) - self.max_learned
            if over > 0:
                for k in list(d)[: over + self.max_learned // 100]:  # oldest first
                    del d[k]  # type: ignore[arg-type]

    # -- runtime self-check ----------------------------------------------------------

    def _tagged_extra(self, ev: BlockStored, j: int) -> tuple[Any, ...] | bool | None:
        """Block ``j``'s extra keys re-tagged as vLLM hashes them; False if unknowable."""
        entry = ev.extra_keys[j] if ev.extra_keys and j < len(ev.extra_keys) else None
        if entry is None:
            return False if ev.lora_name else None
        if not isinstance(entry, (list, tuple)):
            return False
        items = list(entry)
        tagged: list[tuple[Any, ...]] = []
        if ev.lora_name:
            if not items or items[0] != ev.lora_name:
                return False
            path = self.lora_paths.get(ev.lora_name)
            if path is None:
                return False
            tagged.append(("lora", items.pop(0), path))
        for x in items:
            if isinstance(x, (list, tuple)) and len(x) == 2:
                tagged.append(("mm", x[0], x[1]))
            elif isinstance(x, str):
                tagged.append(("cache_salt", x))
            elif isinstance(x, bytes):
                tagged.append(("prompt_embeds", x))
            else:
                return False
        return tuple(tagged) or None

    def verify(self, ev: BlockStored) -> bool | None:
        """Re-hash ``ev``'s blocks and compare with the engine's hashes.

        Returns True (match), False (mismatch: the hasher is now disabled) or None (not
        verifiable: disabled, parent digest unknown, no tokens, unknown LoRA path).
        """
        if not self.enabled:
            return None
        hashes = ev.block_hashes
        bs = ev.block_size
        if not hashes or bs <= 0 or len(ev.token_ids) != bs * len(hashes):
            self.unverifiable += 1
            return None
        self.int_hashes = not isinstance(hashes[0], bytes)
        parent: bytes | None
        if ev.parent_block_hash is None:
            parent = None
        elif isinstance(ev.parent_block_hash, bytes):
            parent = ev.parent_block_hash
        else:
            parent = self._digests.get(ev.parent_block_hash)
            if parent is None:
                self.unverifiable += 1
                return None
        digests: list[bytes] = []
        tokens = ev.token_ids
        for j in range(len(hashes)):
            extra = self._tagged_extra(ev, j)
            if extra is False:
                self.unverifiable += 1
                return None
            parent = self.block_digest(parent, tokens[j * bs : (j + 1) * bs], extra)  # type: ignore[arg-type]
            digests.append(parent)
        for j, d in enumerate(digests):
            if self.published(d) != hashes[j]:
                self.mismatches += 1
                self.enabled = False
                log.error(
                    "ENGINE HASH MISMATCH: block %d of a BlockStored hashes to %r with "
                    "algo=%s seed=%r, but the engine published %r. The engine runs another "
                    "algorithm (--prefix-caching-hash-algo), another PYTHONHASHSEED or "
                    "another vLLM version. Engine-hash mode is now DISABLED; orphaned "
                    "chains will be recovered only by replay/resync.",
                    j,
                    self.published(d),
                    self.algo,
                    self.seed,
                    hashes[j],
                )
                return False
        for d, h in zip(digests, hashes, strict=True):
            self._digests[h] = d
        self.matches += 1
        self._bound()
        return True
