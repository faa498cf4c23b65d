"""Prompt rendering + tokenization, exactly as the engine does it.

Every tokenizer implements :class:`PromptTokenizer` (sync); the gateway awaits
:class:`AsyncPromptTokenizer` (:func:`as_async`) or, for ids + block keys with multi-turn
reuse, :class:`ChatEncoder`.  :func:`load_tokenizer` builds one from a spec string:

==========================  ==============================================================
spec                        tokenizer
==========================  ==============================================================
``builtin`` (or empty)      :class:`ByteTokenizer`: UTF-8 bytes + ChatML-style template,
                            shared with the simulated pods (exact against them)
``approx`` / ``approx:N``   :class:`ApproxTokenizer`: N characters per pseudo-token
                            (default 4), flagged ``approximate``
``remote:URL[,URL...]``     :class:`RemoteTokenizer`: the pod's ``POST /tokenize``
``hf:PATH`` or ``PATH``     :class:`HFTokenizer`: a model directory, an HF cache repo or
                            snapshot path, or a repo id present in the local HF cache
==========================  ==============================================================
"""

from __future__ import annotations

import ssl
from collections.abc import Callable

from router.tokenize.aio import ThreadedTokenizer, as_async
from router.tokenize.approx import ApproxTokenizer
from router.tokenize.base import AsyncPromptTokenizer, PromptTokenizer, TokenizeError
from router.tokenize.builtin import ByteTokenizer
from router.tokenize.encoder import ChatEncoder, EncodedPrompt


def load_tokenizer(
    spec: str,
    *,
    model: str | None = None,
    tls: Callable[[], ssl.SSLContext] | None = None,
) -> PromptTokenizer:
    """Build the tokenizer named by ``spec`` (table above); ``model`` is sent to remote pods,
    ``tls`` gives the TLS context for ``https`` ones."""
    spec = spec.strip()
    if spec in ("", "builtin"):
        return ByteTokenizer()
    if spec == "approx" or spec.startswith("approx:"):
        _, _, n = spec.partition(":")
        try:
            return ApproxTokenizer(int(n) if n else 4)
        except ValueError as exc:
            raise TokenizeError(f"bad approx tokenizer spec {spec!r}: {exc}") from None
    if spec.startswith("remote:"):
        from router.tokenize.remote import RemoteTokenizer

        urls = [u.strip() for u in spec.removeprefix("remote:").split(",") if u.strip()]
        if not urls or not all(u.startswith(("http://", "https://")) for u in urls):
            raise TokenizeError(
                f"bad remote tokenizer spec {spec!r}: expected remote:http://host:port"
            )
        return RemoteTokenizer(urls, model=model, tls=tls)
    from router.tokenize.hf import HFTokenizer  # local import: needs model files

    return HFTokenizer.from_dir(spec.removeprefix("hf:"))


__all__ = [
    "ApproxTokenizer",
    "AsyncPromptTokenizer",
    "ByteTokenizer",
    "ChatEncoder",
    "EncodedPrompt",
    "PromptTokenizer",
    "ThreadedTokenizer",
    "TokenizeError",
    "as_async",
    "load_tokenizer",
]
