"""Prompt -> token ids -> block keys, reusing the previous turn of a conversation.

:class:`ChatEncoder` is what the gateway calls for every request.  It wraps any
:class:`~router.tokenize.base.PromptTokenizer` and a :class:`~scoring.blocks.BlockHasher`
and returns an :class:`EncodedPrompt` (token ids + block keys + whether they are an
estimate).  Sync (``encode_chat`` / ``encode_prompt``) and async (``aencode_chat`` /
``aencode_prompt``) entry points are offered for every tokenizer: a tokenizer with its own
``aencode_*`` coroutines (the remote one) is awaited; a local one runs inline, or in a
worker thread when the prompt is longer than ``offload_chars`` characters, so a big render
never stalls the event loop.

Multi-turn reuse (tokenizers with ``render_chat`` + ``encode_with_cuts``, i.e.
:class:`~router.tokenize.hf.HFTokenizer`):

1. the chat is always rendered in full (templates may look at the whole conversation,
   so rendered text is never assumed to be a concatenation of per-message pieces);
2. a bounded LRU (:mod:`router.tokenize.turn_cache`) maps ``H(context, messages[:i])``
   -> the previous request's rendered text ``P``, token ids, block keys and *cut
   points*.  The context hashes tools, template kwargs, LoRA name and cache salt.  The
   longest message prefix of this request present in the LRU is the candidate; failing
   that (a new conversation), the latest request that shares its first 1-4 messages
   (system prompt, tools, few-shot examples);
3. ``L`` = common prefix length of the new text ``T`` and ``P``.  A cut point ``(c, k)`` of
   ``P`` (a non-normalized added token such as ``<|im_start|>`` starting at character
   ``c``, token index ``k``) is usable when ``c + M <= L`` (``M`` = longest added token),
   so the token matcher sees identical text around ``c`` in both.  tokenizers splits on
   such tokens before normalizing/pre-tokenizing, hence
   ``encode(T) == ids_P[:k] + encode(T[c:])``;
4. block keys of the ``k // block_size`` full blocks before the cut are reused and the
   chain is extended over the new tokens.

``verify_every=n`` re-encodes every n-th reused request from scratch and compares; a
mismatch is counted (``stats.verify_failures``), the exact result is returned and reuse
is switched off for this encoder.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
from array import array
from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from router.tokenize.aio import chat_chars
from router.tokenize.base import PromptTokenizer, TokenizeError
from router.tokenize.turn_cache import TurnCache, TurnEntry, common_prefix_len, prefix_hashes
from scoring.blocks import BlockHasher

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class EncodedPrompt:
    """The tokens of one request and the key chain of its full blocks."""

    token_ids: list[int]
    block_keys: list[int]
    #: True when ids are an estimate (approximate tokenizer): hit predictions are too
    approximate: bool = False
    #: leading tokens taken from an earlier turn instead of being tokenized again
    reused_tokens: int = 0


@runtime_checkable
class IncrementalTokenizer(Protocol):
    """A tokenizer that exposes its render step and safe split points (HFTokenizer)."""

    max_added_token_chars: int

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str: ...

    def encode_with_cuts(self, text: str) -> tuple[list[int], list[tuple[int, int]]]: ...


@dataclass
class EncoderStats:
    """Counters since start: ``errors`` counts requests rejected with TokenizeError."""

    requests: int = 0
    errors: int = 0
    reuse_hits: int = 0
    reused_tokens: int = 0
    tokenized_tokens: int = 0
    verify_checks: int = 0
    verify_failures: int = 0


class ChatEncoder:
    """Token ids + block keys for chat and completion requests (see the module docstring).

    Parameters: ``max_entries`` (LRU entries, default 1024) and ``max_cached_tokens``
    (total tokens held, default 4M: about 4 bytes per token + 1-4 bytes per character of
    rendered text), ``verify_every`` (0 = never), ``offload_chars`` (async calls render in a
    thread above this many characters of message content, default 16384).
    """

    def __init__(
        self,
        tokenizer: PromptTokenizer,
        hasher: BlockHasher,
        *,
        max_entries: int = 1024,
        max_cached_tokens: int = 4_000_000,
        verify_every: int = 0,
        offload_chars: int = 16_384,
    ) -> None:
        if max_entries < 0 or max_cached_tokens < 0 or verify_every < 0 or offload_chars < 0:
            raise ValueError(
                "max_entries, max_cached_tokens, verify_every and offload_chars must be >= 0"
            )
        self.tokenizer = tokenizer
        self.hasher = hasher
        self.max_entries = max_entries
        self.max_cached_tokens = max_cached_tokens
        self.verify_every = verify_every
        self.offload_chars = offload_chars
        self.stats = EncoderStats()
        self.reuse_enabled = isinstance(tokenizer, IncrementalTokenizer) and max_entries > 0
        self._turns = TurnCache(max_entries, max_cached_tokens)
        self._lock = threading.Lock()
        self._count_errors = _CountErrors(self)
        self._remote_prompt = getattr(tokenizer, "aencode_prompt", None)
        self._approximate = bool(getattr(tokenizer, "approximate", False))

    @property
    def approximate(self) -> bool:
        return self._approximate

    def inline_prompt(self, prompt: str) -> bool:
        """True when :meth:`aencode_prompt` would only call :meth:`encode_prompt` (a local
        tokenizer and a prompt below ``offload_chars``): the caller may call it directly."""
        return self._remote_prompt is None and len(prompt) <= self.offload_chars

    # --- completions ------------------------------------------------------------------

    def encode_prompt(
        self, prompt: str, *, lora: str | None = None, cache_salt: str | None = None
    ) -> EncodedPrompt:
        with self._count_errors:
            ids = self.tokenizer.encode_prompt(prompt)
        return self._finish(ids, lora, cache_salt)

    async def aencode_prompt(
        self, prompt: str, *, lora: str | None = None, cache_salt: str | None = None
    ) -> EncodedPrompt:
        remote = self._remote_prompt
        if remote is not None:
            with self._count_errors:
                ids = await remote(prompt)
            return self._finish(ids, lora, cache_salt)
        if isinstance(prompt, str) and len(prompt) > self.offload_chars:
            return await asyncio.to_thread(
                self.encode_prompt, prompt, lora=lora, cache_salt=cache_salt
            )
        return self.encode_prompt(prompt, lora=lora, cache_salt=cache_salt)

    # --- chat -------------------------------------------------------------------------

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        lora: str | None = None,
        cache_salt: str | None = None,
    ) -> EncodedPrompt:
        with self._count_errors:
            if not self.reuse_enabled:
                ids = self.tokenizer.encode_chat(
                    messages,
                    tools=tools,
                    add_generation_prompt=add_generation_prompt,
                    chat_template_kwargs=chat_template_kwargs,
                )
                return self._finish(ids, lora, cache_salt)
            return self._encode_incremental(
                messages, tools, add_generation_prompt, chat_template_kwargs, lora, cache_salt
            )

    async def aencode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        lora: str | None = None,
        cache_salt: str | None = None,
    ) -> EncodedPrompt:
        template: dict[str, Any] = dict(
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
        )
        return await self._aencode_messages(messages, template, self.encode_chat, lora, cache_salt)

    async def _aencode_messages(
        self,
        messages: Sequence[Mapping[str, Any]],
        template: dict[str, Any],
        local: Callable[..., EncodedPrompt],
        lora: str | None,
        cache_salt: str | None,
        **remote_only: Any,
    ) -> EncodedPrompt:
        """``messages`` encoded by a remote tokenizer (``template`` and ``remote_only``
        its keyword arguments), else by ``local`` (``template``, lora, cache_salt): in a
        worker thread when the chat is long."""
        remote = getattr(self.tokenizer, "aencode_chat", None)
        if remote is not None:
            with self._count_errors:
                ids = await remote(messages, **template, **remote_only)
            return self._finish(ids, lora, cache_salt)
        kwargs = dict(template, lora=lora, cache_salt=cache_salt)
        if isinstance(messages, Sequence) and chat_chars(messages) > self.offload_chars:
            return await asyncio.to_thread(local, messages, **kwargs)
        return local(messages, **kwargs)

    # --- the Responses API ------------------------------------------------------------

    def encode_responses(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        lora: str | None = None,
        cache_salt: str | None = None,
    ) -> EncodedPrompt:
        """A Responses API request converted to chat ``messages``, as vLLM 0.32 tokenizes
        it: the chat template rendered (with the generation prompt), then tokenized with
        ``add_special_tokens=True`` -- the completion rule, where chat uses False (the
        Responses request's ``TokenizeParams`` keep their default).  With a tokenizer
        that adds a BOS, that is one token more than the same chat request, so a
        response and a chat never share cached blocks.  Tokenizers without a separate
        render step (builtin, approx) encode it as the chat.  No multi-turn reuse."""
        tok: Any = self.tokenizer
        with self._count_errors:
            if isinstance(tok, IncrementalTokenizer) and hasattr(tok, "encode_text"):
                text = tok.render_chat(
                    messages,
                    tools=tools,
                    add_generation_prompt=True,
                    chat_template_kwargs=chat_template_kwargs,
                )
                ids = tok.encode_text(text, add_special_tokens=True)
            else:
                ids = tok.encode_chat(
                    messages, tools=tools, chat_template_kwargs=chat_template_kwargs
                )
        return self._finish(ids, lora, cache_salt)

    async def aencode_responses(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        lora: str | None = None,
        cache_salt: str | None = None,
    ) -> EncodedPrompt:
        """:meth:`encode_responses` (a remote tokenizer: ``/tokenize`` with the chat and
        ``add_special_tokens``; a long render in a worker thread)."""
        template: dict[str, Any] = dict(tools=tools, chat_template_kwargs=chat_template_kwargs)
        return await self._aencode_messages(
            messages, template, self.encode_responses, lora, cache_salt, add_special_tokens=True
        )

    # --- internals --------------------------------------------------------------------

    def _counting_errors(self) -> _CountErrors:
        """A context that counts a TokenizeError in ``stats.errors`` (and re-raises)."""
        return self._count_errors

    def _finish(self, ids: list[int], lora: str | None, cache_salt: str | None) -> EncodedPrompt:
        keys = self.hasher.keys(ids, lora=lora, cache_salt=cache_salt)
        with self._lock:
            self.stats.requests += 1
            self.stats.tokenized_tokens += len(ids)
        return EncodedPrompt(ids, keys, self._approximate)

    def _encode_incremental(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        add_generation_prompt: bool,
        chat_template_kwargs: Mapping[str, Any] | None,
        lora: str | None,
        cache_salt: str | None,
    ) -> EncodedPrompt:
        tok: Any = self.tokenizer
        text: str = tok.render_chat(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
        )
        chain = prefix_hashes(messages, tools, chat_template_kwargs, lora, cache_salt)
        entry = self._turns.find(chain)
        result: tuple[list[int], list[tuple[int, int]], list[int], int] | None = None
        if entry is not None:
            result = self._extend(tok, entry, text, lora, cache_salt)
        if result is None:
            ids, cuts = tok.encode_with_cuts(text)
            keys = self.hasher.keys(ids, lora=lora, cache_salt=cache_salt)
            reused = 0
        else:
            ids, cuts, keys, reused = result
            if self._should_verify():
                exact, _ = tok.encode_with_cuts(text)
                with self._lock:
                    self.stats.verify_checks += 1
                if exact != ids:
                    log.error(
                        "incremental tokenization diverged from a full encode "
                        "(%d vs %d tokens); multi-turn reuse disabled for %s",
                        len(ids),
                        len(exact),
                        getattr(tok, "name", "tokenizer"),
                    )
                    with self._lock:
                        self.stats.verify_failures += 1
                        self.reuse_enabled = False
                    ids, cuts = tok.encode_with_cuts(text)
                    keys = self.hasher.keys(ids, lora=lora, cache_salt=cache_salt)
                    reused = 0
        self._turns.store(chain, TurnEntry(text, array("I", ids), cuts, keys))
        with self._lock:
            self.stats.requests += 1
            self.stats.tokenized_tokens += len(ids) - reused
            if reused:
                self.stats.reuse_hits += 1
                self.stats.reused_tokens += reused
        return EncodedPrompt(ids, keys, approximate=self.approximate, reused_tokens=reused)

    def _extend(
        self, tok: Any, entry: TurnEntry, text: str, lora: str | None, cache_salt: str | None
    ) -> tuple[list[int], list[tuple[int, int]], list[int], int] | None:
        if text == entry.text:
            return entry.ids.tolist(), list(entry.cuts), list(entry.keys), len(entry.ids)
        common = common_prefix_len(text, entry.text)
        limit = common - tok.max_added_token_chars
        # the last cut at or before `limit` (cuts are sorted by character offset)
        best = bisect_right(entry.cuts, (limit, sys.maxsize)) - 1
        if best < 0:
            return None
        char_cut, tok_cut = entry.cuts[best]
        tail_ids, tail_cuts = tok.encode_with_cuts(text[char_cut:])
        ids = entry.ids[:tok_cut].tolist() + tail_ids
        cuts = entry.cuts[: best + 1] + [(c + char_cut, k + tok_cut) for c, k in tail_cuts]
        n_blocks = tok_cut // self.hasher.block_size
        if n_blocks:
            keys = self.hasher.extend(entry.keys[:n_blocks], ids, lora=lora)
        else:
            keys = self.hasher.keys(ids, lora=lora, cache_salt=cache_salt)
        return ids, cuts, keys, tok_cut

    def _should_verify(self) -> bool:
        if not self.verify_every:
            return False
        with self._lock:
            return (self.stats.reuse_hits + 1) % self.verify_every == 0

    def cache_info(self) -> dict[str, int]:
        """Entries and tokens currently held by the reuse cache."""
        return self._turns.info()


class _CountErrors:
    """Counts a :class:`TokenizeError` raised inside ``with`` (a class, not a
    ``@contextmanager`` generator: this runs on every request)."""

    __slots__ = ("_encoder",)

    def __init__(self, encoder: ChatEncoder) -> None:
        self._encoder = encoder

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        if exc_type is not None and issubclass(exc_type, TokenizeError):
            with self._encoder._lock:
                self._encoder.stats.errors += 1
