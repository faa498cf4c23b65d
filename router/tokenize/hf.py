"""A model's own tokenizer: ``tokenizer.json`` + chat template, no network, no transformers.

:meth:`HFTokenizer.from_dir` loads what ``AutoTokenizer.from_pretrained`` (transformers 5,
fast tokenizer backend) would, from a model directory, a Hugging Face cache repository
(``.../hub/models--org--name``, via ``refs/main``), one of its ``snapshots/<rev>``
directories, or a repo id (``org/name``) found in the local HF cache:

* ``tokenizer.json`` with the ``tokenizers`` library;
* ``tokenizer_config.json``: the named special tokens (``bos_token``, ``eos_token``, ...,
  strings or ``{"content": ...}`` objects), ``added_tokens_decoder`` and
  ``extra_special_tokens`` / ``additional_special_tokens`` (added to the vocabulary as
  special tokens when ``tokenizer.json`` lacks them).  ``add_bos_token`` /
  ``add_eos_token`` are ignored, as transformers 5 ignores them whenever a
  ``tokenizer.json`` exists: completion prompts get exactly what the ``tokenizer.json``
  post-processor adds;
* the chat template, by the priority transformers uses: ``chat_template.jinja`` (plus named
  ``additional_chat_templates/*.jinja``) over ``tokenizer_config.json["chat_template"]``
  (a string, or a list of ``{"name", "template"}``); ``chat_template.json`` (the legacy
  processor file) is used when neither exists.  With several named templates, a request
  with tools uses ``tool_use`` when present, else ``default``.

Chat prompts: normalise messages as vLLM does (:mod:`router.tokenize.conversation`),
render (:mod:`router.tokenize.template`), tokenize with ``add_special_tokens=False``.
Completion prompts: tokenize with ``add_special_tokens=True``.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

from router.tokenize.base import TokenizeError
from router.tokenize.conversation import (
    detect_content_format,
    normalize_messages,
    normalize_tools,
    supports_developer_role,
)
from router.tokenize.template import compile_template, render_template

log = logging.getLogger(__name__)

#: tokenizer classes that use tokenizer.json exactly as saved (transformers 5 maps a
#: model-specific class such as Qwen2Tokenizer or LlamaTokenizer to code that rebuilds the
#: normalizer and pre-tokenizer from vocab + merges, which may differ from the file)
GENERIC_TOKENIZER_CLASSES = frozenset(
    {"", "PreTrainedTokenizer", "TokenizersBackend", "GPT2Tokenizer"}
)

#: the named special tokens transformers exposes to templates (``special_tokens_map``)
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class TokenizerFilesError(TokenizeError):
    """The model directory is missing files or holds invalid ones."""


def hf_cache_dir() -> Path:
    """``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def resolve_model_dir(spec: str | os.PathLike[str]) -> Path:
    """The directory holding ``tokenizer.json`` for ``spec`` (see the module docstring)."""
    path = Path(spec).expanduser()
    if not path.exists() and "/" in str(spec) and not str(spec).startswith(("/", ".", "~")):
        path = hf_cache_dir() / ("models--" + str(spec).replace("/", "--"))
    if (path / "snapshots").is_dir():
        ref = path / "refs" / "main"
        if ref.is_file():
            snapshot = path / "snapshots" / ref.read_text().strip()
        else:
            snapshots = sorted((path / "snapshots").iterdir(), key=lambda p: p.stat().st_mtime)
            if not snapshots:
                raise TokenizerFilesError(f"{path}: HF cache repository has no snapshots")
            snapshot = snapshots[-1]
        path = snapshot
    if not (path / "tokenizer.json").is_file():
        raise TokenizerFilesError(
            f"{spec}: no tokenizer.json found (looked in {path}); give a model directory, "
            "an HF cache snapshot, or a repo id present in the local HF cache"
        )
    return path


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerFilesError(f"{path}: cannot read JSON: {exc}") from exc


def _token_content(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _added_token(value: Any, *, special: bool = True) -> AddedToken | None:
    if isinstance(value, str):
        return AddedToken(value, special=special, normalized=not special)
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        spec = bool(value.get("special", special))
        return AddedToken(
            value["content"],
            single_word=bool(value.get("single_word", False)),
            lstrip=bool(value.get("lstrip", False)),
            rstrip=bool(value.get("rstrip", False)),
            normalized=bool(value.get("normalized", not spec)),
            special=spec,
        )
    return None


def _load_templates(root: Path, config: Mapping[str, Any]) -> dict[str, str]:
    templates: dict[str, str] = {}
    jinja_file = root / "chat_template.jinja"
    extra_dir = root / "additional_chat_templates"
    if jinja_file.is_file():
        templates["default"] = jinja_file.read_text(encoding="utf-8")
    if extra_dir.is_dir():
        for f in sorted(extra_dir.glob("*.jinja")):
            templates[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
    if templates:
        return templates
    raw = config.get("chat_template")
    if isinstance(raw, str):
        return {"default": raw}
    if isinstance(raw, list):
        for entry in raw:
            if isinstance(entry, Mapping) and isinstance(entry.get("template"), str):
                templates[str(entry.get("name", "default"))] = entry["template"]
        return templates
    legacy = root / "chat_template.json"
    if legacy.is_file():
        data = _read_json(legacy)
        if isinstance(data, Mapping) and isinstance(data.get("chat_template"), str):
            return {"default": data["chat_template"]}
    return {}


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


class HFTokenizer:
    """A Hugging Face fast tokenizer + chat template, rendering like vLLM (see module doc)."""

    approximate = False

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        templates: Mapping[str, str] | None = None,
        special_tokens: Mapping[str, str] | None = None,
        name: str = "hf",
        parallel_chars: int = 16_384,
        parallel_chunks: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        #: chat texts longer than this are split at safe special tokens and the pieces
        #: tokenized in parallel (``encode_batch``); 0 disables splitting
        self.parallel_chars = parallel_chars
        self.parallel_chunks = parallel_chunks or max(2, os.cpu_count() or 2)
        self.templates = dict(templates or {})
        self.special_tokens = dict(special_tokens or {})
        self.name = name
        #: ``tokenizer_config.json``'s ``tokenizer_class`` ("" when absent)
        self.tokenizer_class = ""
        #: reasons to doubt exactness found at load time (also logged)
        self.warnings: list[str] = []
        for source in self.templates.values():
            compile_template(source)  # fail at load time, not on the first request
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

    # --- loading ----------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> HFTokenizer:
        """Load from a model directory, an HF cache repo/snapshot path or a cached repo id."""
        root = resolve_model_dir(path)
        try:
            tok = Tokenizer.from_file(str(root / "tokenizer.json"))
        except Exception as exc:  # tokenizers raises a bare Exception on bad files
            raise TokenizerFilesError(f"{root / 'tokenizer.json'}: {exc}") from exc
        config_path = root / "tokenizer_config.json"
        config = _read_json(config_path) if config_path.is_file() else {}
        if not isinstance(config, Mapping):
            raise TokenizerFilesError(f"{config_path}: expected a JSON object")
        special = {
            name: content
            for name in SPECIAL_TOKEN_NAMES
            if (content := _token_content(config.get(name))) is not None
        }
        _add_missing_tokens(tok, config, special)
        out = cls(
            tok,
            templates=_load_templates(root, config),
            special_tokens=special,
            name=f"hf:{root}",
        )
        out.tokenizer_class = str(config.get("tokenizer_class") or "")
        if out.tokenizer_class.removesuffix("Fast") not in GENERIC_TOKENIZER_CLASSES:
            out.warnings.append(
                f"tokenizer_class {out.tokenizer_class!r}: transformers may rebuild this "
                "tokenizer's normalizer/pre-tokenizer in code instead of using "
                "tokenizer.json as is; confirm with router.tokenize.verify."
                "check_against_engine (or use tokenizer=remote:)"
            )
            log.warning("%s: %s", out.name, out.warnings[-1])
        return out

    # --- PromptTokenizer ----------------------------------------------------------------

    def template_source(self, tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The chat template a request uses (``tool_use`` for requests with tools if named)."""
        if not self.templates:
            raise TokenizeError(
                f"{self.name}: the model has no chat template (tokenizer_config.json "
                "chat_template / chat_template.jinja); chat requests cannot be tokenized"
            )
        if len(self.templates) == 1:
            return next(iter(self.templates.values()))
        if tools is not None and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        raise TokenizeError(
            f"{self.name}: several chat templates {sorted(self.templates)} and none is 'default'"
        )

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text vLLM renders for this chat request."""
        tool_dicts = normalize_tools(tools)
        source = self.template_source(tool_dicts)
        kwargs = dict(chat_template_kwargs or {})
        for bad in ("chat_template", "tokenize"):
            if bad in kwargs:
                raise TokenizeError(f"chat_template_kwargs must not contain {bad!r}")
        continue_final = bool(kwargs.pop("continue_final_message", False))
        if continue_final and add_generation_prompt:
            raise TokenizeError(
                "continue_final_message and add_generation_prompt cannot both be true"
            )
        kwargs.pop("add_generation_prompt", None)
        documents = kwargs.pop("documents", None)
        conversation = normalize_messages(
            messages,
            detect_content_format(source),
            developer_role=supports_developer_role(source),
        )
        final_text = _tag_final_message(conversation, source) if continue_final else ""
        text = render_template(
            source,
            conversation,
            tools=tool_dicts,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens,
            extra=kwargs,
        )
        return _cut_at_tag(text, final_text) if continue_final else text

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        text = self.render_chat(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            chat_template_kwargs=chat_template_kwargs,
        )
        return self.encode_text(text, add_special_tokens=False)

    def encode_prompt(self, prompt: str) -> list[int]:
        if not isinstance(prompt, str):
            raise TokenizeError(f"prompt must be a string, got {type(prompt).__name__}")
        return self.encode_text(prompt, add_special_tokens=True)

    def encode_text(self, text: str, *, add_special_tokens: bool) -> list[int]:
        if not add_special_tokens:
            return self.encode_with_cuts(text)[0]
        return list(self.tokenizer.encode(text, add_special_tokens=True).ids)

    # --- chat-mode encoding with cut points (used by ChatEncoder) --------------------------

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


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tag_final_message(conversation: list[dict[str, Any]], source: str) -> str:
    """Mark the end of the last message's text (transformers' continue_final_message)."""
    final = conversation[-1].get("content")
    if "content" not in source:
        raise TokenizeError("continue_final_message: the chat template never reads 'content'")
    if isinstance(final, list):
        for part in reversed(final):
            if "text" in part:
                text = str(part["text"])
                part["text"] = text + _CONTINUE_TAG
                return text
        raise TokenizeError("continue_final_message: the final message has no text to continue")
    if not isinstance(final, str):
        raise TokenizeError("continue_final_message: the final message has no content")
    conversation[-1]["content"] = final + _CONTINUE_TAG
    return final


def _cut_at_tag(rendered: str, final_text: str) -> str:
    """Drop everything from the tag on, as transformers does (rstrip if it was trimmed)."""
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in rendered or tag not in rendered:
        raise TokenizeError(
            "continue_final_message: the final message does not appear in the rendered chat"
        )
    loc = rendered.rindex(tag)
    if rendered[loc : loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:loc]
    return rendered[:loc].rstrip()


def _add_missing_tokens(
    tok: Tokenizer, config: Mapping[str, Any], special: Mapping[str, str]
) -> None:
    """Add special tokens named by the config but absent from ``tokenizer.json``."""
    vocab = tok.get_vocab(with_added_tokens=True)
    to_add: list[AddedToken] = []
    seen: set[str] = set()

    def want(value: Any, *, special_default: bool = True) -> None:
        token = _added_token(value, special=special_default)
        if token is not None and token.content not in vocab and token.content not in seen:
            seen.add(token.content)
            to_add.append(token)

    decoder = config.get("added_tokens_decoder")
    if isinstance(decoder, Mapping):
        for _, value in sorted(decoder.items(), key=lambda kv: int(kv[0])):
            want(value)
    for content in special.values():
        want(content)
    for key in ("extra_special_tokens", "additional_special_tokens"):
        extra = config.get(key)
        if isinstance(extra, Mapping):
            extra = list(extra.values())
        if isinstance(extra, list):
            for value in extra:
                want(value)
    if to_add:
        tok.add_special_tokens(to_add)
