"""Chat-mode encoding with safe cut points, and its parallel split of long texts.

:class:`CutEncoding` is the part of :class:`~router.tokenize.hf.HFTokenizer` that
:class:`~router.tokenize.encoder.ChatEncoder` relies on for multi-turn reuse
(``encode_with_cuts``, ``max_added_token_chars``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer


@dataclass(frozen=True)
class CutToken:
    """An added token whose start is a safe place to split text before tokenizing.

    tokenizers splits the input on non-normalized added tokens before normalizing and
    pre-tokenizing each piece independently, so ``encode(a + b) == encode(a) + encode(b)``
    when ``b`` starts with such a token (not lstrip / single_word, not starting with
    whitespace) and that token is matched there in ``a + b``.
    """

    token_id: int
    content: str


class CutEncoding:
    """Cut points of a :class:`tokenizers.Tokenizer`'s chat-mode encodings (a mixin: the
    class using it sets ``tokenizer``, ``parallel_chars`` and ``parallel_chunks``, then
    calls :meth:`_setup_cuts`)."""

    tokenizer: Tokenizer
    parallel_chars: int
    parallel_chunks: int

    def _setup_cuts(self) -> None:
        tokenizer = self.tokenizer
        self._cut_tokens = self._find_cut_tokens()
        self._cut_ids = {t.content: t.token_id for t in self._cut_tokens.values()}
        self._cut_pattern = (
            re.compile("|".join(re.escape(c) for c in sorted(self._cut_ids, key=len, reverse=True)))
            if self._cut_ids
            else None
        )
        lengths = [len(t.content) for t in tokenizer.get_added_tokens_decoder().values()]
        #: the longest added token, in characters (bounds look-ahead of token matching)
        self.max_added_token_chars = max(lengths, default=0)
        self._batch_fast = getattr(tokenizer, "encode_batch_fast", None)  # tokenizers >= 0.21
        split = self._find_split_tokens()
        self._split_pattern = (
            re.compile("|".join(re.escape(c) for c in sorted(split, key=len, reverse=True)))
            if split
            else None
        )

    def encode_with_cuts(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Chat-mode ids of ``text`` (``add_special_tokens=False``) and its safe cut points.

        A cut ``(c, k)`` means ``ids[:k]`` is exactly the encoding of ``text[:c]`` and
        ``text[c:]`` starts with a cut token (:class:`CutToken`) matched at ``c``.

        Texts longer than ``parallel_chars`` are split before *split tokens* (cut tokens
        that no other added token can overlap) into about ``parallel_chunks`` pieces,
        encoded with ``encode_batch_fast`` (Rust threads, no offsets), and each piece is
        checked to start with its split token.  Cut points come from pairing the cut
        tokens' occurrences in the text with their ids; any surprise falls back to one
        sequential encode with offsets.
        """
        starts = self._split_points(text)
        pieces = [text[a:b] for a, b in zip(starts, [*starts[1:], len(text)], strict=True)]
        ids: list[int] = []
        cuts: list[tuple[int, int]] = []
        for start, piece, piece_ids in zip(starts, pieces, self._encode_fast(pieces), strict=True):
            if start:
                expected = self._cut_ids.get(self._split_content(piece))
                if not piece_ids or piece_ids[0] != expected:
                    break  # the split token was not matched as expected
                cuts.append((start, len(ids)))
            piece_cuts = self._cuts_from_ids(piece, piece_ids)
            if piece_cuts is None:
                break
            base = len(ids)
            cuts.extend((start + c, base + k) for c, k in piece_cuts)
            ids.extend(piece_ids)
        else:
            return ids, cuts
        # a surprise (a token another added token overlapped): one encode with offsets
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        ids = enc.ids
        return ids, self._cuts_in(text, enc, ids)

    def _encode_fast(self, pieces: list[str]) -> list[list[int]]:
        """Ids of each piece, without offsets (``encode_batch_fast``, Rust threads)."""
        if self._batch_fast is not None:
            return [e.ids for e in self._batch_fast(pieces, add_special_tokens=False)]
        return [e.ids for e in self.tokenizer.encode_batch(pieces, add_special_tokens=False)]

    def _cuts_from_ids(self, text: str, ids: list[int]) -> list[tuple[int, int]] | None:
        """Cut points found by pairing the cut tokens' textual occurrences, in order, with
        their ids in ``ids``; ``None`` when the counts disagree (an occurrence that was not
        matched as a token), so offsets must be used instead."""
        if self._cut_pattern is None:
            return []
        by_content = self._cut_ids
        matches = [(m.start(), by_content[m.group()]) for m in self._cut_pattern.finditer(text)]
        wanted: dict[int, int] = {}
        for _, tid in matches:
            wanted[tid] = wanted.get(tid, 0) + 1
        if any(ids.count(tid) != n for tid, n in wanted.items()):
            return None
        cuts = []
        k = -1
        for start, tid in matches:
            k = ids.index(tid, k + 1)
            if k:
                cuts.append((start, k))
        return cuts

    def _cuts_in(self, text: str, enc: Any, ids: list[int]) -> list[tuple[int, int]]:
        cuts = []
        if self._cut_pattern is not None:
            by_content = self._cut_ids
            for match in self._cut_pattern.finditer(text):
                start = match.start()
                k = enc.char_to_token(start)
                if (
                    k  # not None, not the first token
                    and ids[k] == by_content[match.group()]
                    and enc.token_to_chars(k)[0] == start
                ):
                    cuts.append((start, k))
        return cuts

    def _split_content(self, piece: str) -> str:
        match = self._split_pattern.match(piece) if self._split_pattern is not None else None
        return match.group() if match else ""

    def _split_points(self, text: str) -> list[int]:
        if (
            self._split_pattern is None
            or not self.parallel_chars
            or len(text) < self.parallel_chars
            or self.parallel_chunks < 2
        ):
            return [0]
        step = len(text) // self.parallel_chunks
        starts = [0]
        goal = step
        for match in self._split_pattern.finditer(text, step):
            if match.start() >= goal:
                starts.append(match.start())
                goal = match.start() + step
        return starts

    def _find_split_tokens(self) -> set[str]:
        """Cut tokens no other added token can overlap (start before and run into them).

        Such a token's every occurrence in a text is matched as itself unless a longer
        token starts at the same place (caught by checking each piece's first token).
        """
        contents = [t.content for t in self.tokenizer.get_added_tokens_decoder().values()]
        safe = set()
        for cut in self._cut_ids:
            overlapped = False
            for other in contents:
                if other == cut:
                    continue
                for i in range(1, len(other)):
                    tail = other[i:]
                    if tail.startswith(cut) or cut.startswith(tail):
                        overlapped = True
                        break
                if overlapped:
                    break
            if not overlapped:
                safe.add(cut)
        return safe

    def _find_cut_tokens(self) -> dict[int, CutToken]:
        out = {}
        for tid, added in self.tokenizer.get_added_tokens_decoder().items():
            content = added.content
            if (
                not added.normalized
                and not added.lstrip
                and not added.single_word
                and content
                and not content[0].isspace()
            ):
                out[tid] = CutToken(tid, content)
        return out
