"""Names shared by the Redis stores: the key layout of a namespace, name checks, and the
cancellation check of their background loops."""

from __future__ import annotations

import asyncio

__all__ = ["Layout", "check_name", "raise_if_cancelled"]


def check_name(what: str, value: str) -> bytes:
    """``value`` as bytes; ValueError naming ``what`` when empty, not a str, or with NUL."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string, got {value!r}")
    if "\0" in value:
        raise ValueError(f"{what} must not contain NUL characters, got {value!r}")
    return value.encode()


class Layout:
    """Key names of one namespace, all sharing the hash tag ``{namespace}``."""

    def __init__(self, namespace: str) -> None:
        raw = check_name("namespace", namespace)
        if b"{" in raw or b"}" in raw:
            raise ValueError(f"namespace must not contain braces, got {namespace!r}")
        self.prefix = b"{" + raw + b"}:"
        self.hints = self.prefix + b"h"  # HASH block key -> holder hint
        self.digests = self.prefix + b"d"  # HASH block key -> digest of its hint
        self.pods = self.prefix + b"p:"  # + tier: pod -> slot id
        self.ids = self.prefix + b"ids"
        self.next = self.prefix + b"next"
        self.seen = self.prefix + b"seen"
        self.load_replicas = self.prefix + b"load:r"
        self.load_hash = self.prefix + b"load:h:"
        self.writer = self.prefix + b"writer"  # STRING: the writer lease's holder
        self.epoch = self.prefix + b"epoch"  # STRING: a random id, new when data was lost


def raise_if_cancelled(cause: BaseException | None = None) -> None:
    """Raise ``CancelledError`` when the current task was asked to stop.

    redis-py can swallow a ``CancelledError`` delivered while a command is in flight
    (the command then returns, or fails with a connection error), so a background loop
    that must end when cancelled checks this after every call; otherwise
    ``task.cancel(); await task`` would wait forever.
    """
    task = asyncio.current_task()
    cancelling = getattr(task, "cancelling", None)  # Python >= 3.11
    if cancelling is not None and cancelling() > 0:
        raise asyncio.CancelledError() from cause
