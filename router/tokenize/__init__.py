"""Prompt rendering + tokenization, exactly as the engine does it.

Every tokenizer implements :class:`PromptTokenizer`.  :func:`load_tokenizer` builds one
from a spec string:

* ``"builtin"`` — a dependency-free byte tokenizer (UTF-8 bytes + a ChatML-style
  template).  The embedded simulated fleet and the router share it, so routing is
  exact against simulated pods with no model files.
* a model directory (``tokenizer.json`` + ``tokenizer_config.json``) — see
  :mod:`router.tokenize.hf`.
"""

from __future__ import annotations

from router.tokenize.base import PromptTokenizer, TokenizeError
from router.tokenize.builtin import ByteTokenizer


def load_tokenizer(spec: str) -> PromptTokenizer:
    if spec in ("", "builtin"):
        return ByteTokenizer()
    from router.tokenize.hf import HFTokenizer  # local import: needs model files

    return HFTokenizer.from_dir(spec)


__all__ = ["ByteTokenizer", "PromptTokenizer", "TokenizeError", "load_tokenizer"]
