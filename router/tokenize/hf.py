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

import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import Tokenizer

from router.tokenize.base import TokenizeError
from router.tokenize.continue_final import cut_at_tag, tag_final_message
from router.tokenize.conversation import (
    detect_content_format,
    normalize_messages,
    normalize_tools,
    supports_developer_role,
)
from router.tokenize.cuts import CutEncoding, CutToken
from router.tokenize.hf_files import (
    GENERIC_TOKENIZER_CLASSES,
    SPECIAL_TOKEN_NAMES,
    TokenizerFilesError,
    add_missing_tokens,
    hf_cache_dir,
    load_templates,
    read_json,
    resolve_model_dir,
    token_content,
)
from router.tokenize.template import compile_template, render_template

log = logging.getLogger(__name__)

__all__ = [
    "GENERIC_TOKENIZER_CLASSES",
    "SPECIAL_TOKEN_NAMES",
    "CutToken",
    "HFTokenizer",
    "TokenizerFilesError",
    "hf_cache_dir",
    "resolve_model_dir",
]


class HFTokenizer(CutEncoding):
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
        self._setup_cuts()

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
        config = read_json(config_path) if config_path.is_file() else {}
        if not isinstance(config, Mapping):
            raise TokenizerFilesError(f"{config_path}: expected a JSON object")
        special = {
            name: content
            for name in SPECIAL_TOKEN_NAMES
            if (content := token_content(config.get(name))) is not None
        }
        add_missing_tokens(tok, config, special)
        out = cls(
            tok,
            templates=load_templates(root, config),
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
        final_text = tag_final_message(conversation, source) if continue_final else ""
        text = render_template(
            source,
            conversation,
            tools=tool_dicts,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens,
            extra=kwargs,
        )
        return cut_at_tag(text, final_text) if continue_final else text

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
