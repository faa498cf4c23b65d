"""A vLLM KV block pool: the one resource of a simulated engine.

Modelled on vLLM V1's ``BlockPool`` (``vllm/v1/core/block_pool.py``) and its
``FreeKVCacheBlockQueue`` (``vllm/v1/core/kv_cache_utils.py``):

* ``num_blocks`` physical blocks.  A running request holds its blocks with a reference
  count (two requests sharing a cached prefix hold the same blocks, ref 2); a block
  with ref 0 is *free*, whether or not it still caches a prefix.
* Free blocks wait in one queue in eviction order.  A new block is taken from its head
  (the least recently freed); if that block still caches a prefix, the prefix entry is
  evicted then.  Freeing appends to the tail in the order given: vLLM frees a request's
  blocks ``reversed(blocks)``, so its tail block is nearer the head and goes first.
  Blocks never used yet sit at the head (vLLM's queue starts with all of them), so they
  are taken before any cached one.
* A *hit* on a free cached block takes it out of the queue (``touch``, ref 0 -> 1):
  a block held by a running request is never evicted.
* The prefix cache maps a block key to a block.  vLLM does not deduplicate: when two
  requests compute the same block, both blocks are cached under that key and a lookup
  returns the first; evicting it exposes the second.
* ``usage`` = blocks with ref > 0 / all blocks, as ``vllm:kv_cache_usage_perc``
  (cached-but-free blocks count as free).  vLLM reserves one "null" block; not modelled.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence


class BlockPool:
    """Physical KV blocks with ref counts, an LRU free queue and a prefix-cache map."""

    __slots__ = (
        "_cached",
        "_dups",
        "_free",
        "_key",
        "_never_used",
        "_ref",
        "num_blocks",
        "on_evict",
    )

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._never_used = num_blocks  # ids num_blocks - _never_used .. num_blocks - 1
        self._free: OrderedDict[int, None] = OrderedDict()  # head = least recently freed
        self._ref = [0] * num_blocks
        self._key: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}  # key -> the block a lookup returns
        self._dups: dict[int, list[int]] = {}  # key -> further blocks caching that key
        #: called with the key of each cached block an allocation evicts (a simulated
        #: server publishes BlockRemoved from it); None in the replay
        self.on_evict: Callable[[int], None] | None = None

    # --- what the engine and the router see -------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks a request can be given now (never used, or free in the queue)."""
        return self._never_used + len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by running requests (0..1)."""
        return 1.0 - self.num_free / self.num_blocks

    @property
    def resident_blocks(self) -> int:
        """Distinct block keys in the prefix cache (held or free)."""
        return len(self._cached)

    def hit_blocks(self, keys: Sequence[int]) -> int:
        """Leading blocks of ``keys`` the prefix cache holds (a KV-event index's answer)."""
        cached = self._cached
        n = 0
        for k in keys:
            if k not in cached:
                break
            n += 1
        return n

    def match(self, keys: Iterable[int]) -> list[int]:
        """The blocks caching the longest prefix of ``keys`` (does not touch them)."""
        get = self._cached.get
        out: list[int] = []
        for k in keys:
            b = get(k)
            if b is None:
                break
            out.append(b)
        return out

    def is_free(self, block: int) -> bool:
        return self._ref[block] == 0

    def cached_key(self, block: int) -> int | None:
        return self._key[block]

    def free_queue(self) -> list[int]:
        """Free blocks in eviction order (head first; never-used blocks not listed)."""
        return list(self._free)

    # --- what the scheduler does ------------------------------------------------

    def touch(self, blocks: Iterable[int]) -> None:
        """A request takes a reference to cached blocks it hit."""
        ref, free = self._ref, self._free
        for b in blocks:
            if ref[b] == 0:
                del free[b]
            ref[b] += 1

    def allocate(self, n: int) -> list[int]:
        """``n`` new blocks (ref 1), evicting the prefixes the taken blocks cached."""
        if n > self.num_free:
            raise ValueError(f"cannot allocate {n} blocks, {self.num_free} free")
        out: list[int] = []
        fresh = min(n, self._never_used)
        if fresh:
            start = self.num_blocks - self._never_used
            out.extend(range(start, start + fresh))
            self._never_used -= fresh
        pop = self._free.popitem
        key = self._key
        for _ in range(n - fresh):
            b = pop(last=False)[0]
            if key[b] is not None:
                self._uncache(b)
            out.append(b)
        ref = self._ref
        for b in out:
            ref[b] = 1
        return out

    def free(self, blocks_in_eviction_order: Iterable[int]) -> None:
        """Drop one reference to each block; blocks reaching ref 0 join the queue tail
        in the order given (the first given is evicted first)."""
        ref, free = self._ref, self._free
        for b in blocks_in_eviction_order:
            ref[b] -= 1
            if ref[b] == 0:
                free[b] = None

    def cache(self, block: int, key: int) -> None:
        """Register a full block under ``key`` (vLLM's ``cache_full_blocks``)."""
        self._key[block] = key
        if key in self._cached:
            self._dups.setdefault(key, []).append(block)
        else:
            self._cached[key] = block

    def _uncache(self, block: int) -> None:
        key = self._key[block]
        assert key is not None
        self._key[block] = None
        if self.on_evict is not None:
            self.on_evict(key)
        dups = self._dups.get(key)
        if self._cached[key] == block:
            if dups:
                self._cached[key] = dups.pop(0)
                if not dups:
                    del self._dups[key]
            else:
                del self._cached[key]
        else:
            assert dups is not None
            dups.remove(block)
            if not dups:
                del self._dups[key]
