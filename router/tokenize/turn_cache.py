"""The multi-turn reuse cache of :class:`~router.tokenize.encoder.ChatEncoder`: what an
earlier request of a conversation rendered and tokenized, found again by the messages
this request shares with it.

A chat's key chain is ``H(context, messages[:i])`` for every ``i`` (:func:`prefix_hashes`:
the context hashes tools, template kwargs, LoRA name and cache salt).  :class:`TurnCache`
is a bounded LRU from the chain's last key to the request's rendered text, token ids,
block keys and cut points (:class:`TurnEntry`).  A request finds the entry of its longest
cached message prefix (its own previous turn) or, failing that (a new conversation), the
latest request that shared its first 1..:data:`SHARED_PREFIX_MESSAGES` messages (a system
prompt, tools, few-shot turns).  Bounded by entries and by the tokens held; thread-safe
(the encoder renders long chats in worker threads).
"""

from __future__ import annotations

import json
import threading
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import xxhash

from router.tokenize.base import TokenizeError

#: a request whose own history is not cached may still reuse the latest cached request
#: that shares its first 1..SHARED_PREFIX_MESSAGES messages (system prompt, few-shot turns)
SHARED_PREFIX_MESSAGES = 4
_h64 = xxhash.xxh3_64_intdigest


@dataclass(slots=True)
class TurnEntry:
    """One request's render and tokenization, kept for the next turn."""

    text: str
    ids: array  # array('I')
    cuts: list[tuple[int, int]]
    keys: list[int]
    size: int = field(default=0)


def common_prefix_len(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b`` (C-speed slice compares)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo]; a[:hi] != b[:hi]
    while hi - lo > 32:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    while lo < hi and a[lo] == b[lo]:
        lo += 1
    return lo


def _digest(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, default=str).encode()


def _message_digest(msg: Any) -> int:
    """64-bit digest of one message: role + content fast path, canonical JSON otherwise."""
    if type(msg) is dict and len(msg) == 2:
        role, content = msg.get("role"), msg.get("content")
        if type(role) is str and type(content) is str:
            return _h64(
                b"\x01" + role.encode() + b"\x00" + content.encode("utf-8", "surrogatepass")
            )
    if isinstance(msg, Mapping):
        content = msg.get("content")
        rest = {k: v for k, v in msg.items() if k != "content"}
        body = (
            content.encode("utf-8", "surrogatepass")
            if isinstance(content, str)
            else _digest(content)
        )
        return _h64(_digest(rest) + b"\x00" + body)
    return _h64(_digest(msg))


def prefix_hashes(
    messages: Sequence[Mapping[str, Any]],
    tools: Any,
    kwargs: Any,
    lora: str | None,
    cache_salt: str | None,
) -> list[int]:
    """``[H(context), H(context, messages[:1]), ..., H(context, messages)]``."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TokenizeError("messages must be a list of message objects")
    h = _h64(_digest([tools, kwargs, lora, cache_salt]))
    chain = [h]
    for msg in messages:
        h = _h64(h.to_bytes(8, "little") + _message_digest(msg).to_bytes(8, "little"))
        chain.append(h)
    return chain


class TurnCache:
    """At most ``max_entries`` entries and ``max_cached_tokens`` tokens, least recently
    used out first (module docstring)."""

    def __init__(self, max_entries: int, max_cached_tokens: int) -> None:
        self.max_entries = max_entries
        self.max_cached_tokens = max_cached_tokens
        self._lru: OrderedDict[int, TurnEntry] = OrderedDict()
        #: H(context, messages[:i]) for i <= SHARED_PREFIX_MESSAGES -> key of the latest entry
        self._heads: OrderedDict[int, int] = OrderedDict()
        self._cached_tokens = 0
        self._lock = threading.Lock()

    def find(self, chain: list[int]) -> TurnEntry | None:
        """The entry of the longest message prefix of ``chain`` held, else the latest
        entry sharing its first messages, else None."""
        with self._lock:
            for h in reversed(chain[1:]):
                entry = self._lru.get(h)
                if entry is not None:
                    self._lru.move_to_end(h)
                    return entry
            # a new conversation that starts like a recent one (shared system prompt, tools,
            # few-shot examples): the latest request with the same first messages
            for h in reversed(chain[1 : SHARED_PREFIX_MESSAGES + 1]):
                key = self._heads.get(h)
                entry = self._lru.get(key) if key is not None else None
                if entry is not None:
                    return entry
        return None

    def store(self, chain: list[int], entry: TurnEntry) -> None:
        """Keep ``entry`` as the request whose key chain is ``chain``."""
        entry.size = len(entry.ids)
        if entry.size > self.max_cached_tokens:
            return
        key = chain[-1]
        with self._lock:
            old = self._lru.pop(key, None)
            if old is not None:
                self._cached_tokens -= old.size
            self._lru[key] = entry
            self._cached_tokens += entry.size
            for h in chain[1 : SHARED_PREFIX_MESSAGES + 1]:
                self._heads[h] = key
                self._heads.move_to_end(h)
            while len(self._heads) > SHARED_PREFIX_MESSAGES * max(1, self.max_entries):
                self._heads.popitem(last=False)
            while self._lru and (
                len(self._lru) > self.max_entries or self._cached_tokens > self.max_cached_tokens
            ):
                _, evicted = self._lru.popitem(last=False)
                self._cached_tokens -= evicted.size

    def info(self) -> dict[str, int]:
        """Entries and tokens currently held."""
        with self._lock:
            return {"entries": len(self._lru), "tokens": self._cached_tokens}
