"""A model's tokenizer files: where they are, and what ``tokenizer_config.json`` adds.

Finds the directory holding ``tokenizer.json`` (a model directory, a Hugging Face cache
repository or snapshot, or a repo id in the local HF cache), reads the chat templates by
transformers' priority, and adds the special tokens the config names but ``tokenizer.json``
lacks.  :class:`~router.tokenize.hf.HFTokenizer` loads through these.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer

from router.tokenize.base import TokenizeError

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


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerFilesError(f"{path}: cannot read JSON: {exc}") from exc


def token_content(value: Any) -> str | None:
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


def load_templates(root: Path, config: Mapping[str, Any]) -> dict[str, str]:
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
        data = read_json(legacy)
        if isinstance(data, Mapping) and isinstance(data.get("chat_template"), str):
            return {"default": data["chat_template"]}
    return {}


def add_missing_tokens(
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
