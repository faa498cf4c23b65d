"""Index writes produced by applying KV events (:class:`IndexOps`), run on any
:class:`~scoring.index.base.BlockIndex` or on one with a synchronous fast path."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

from scoring.index.base import BlockIndex


class SyncIndex(Protocol):
    """The synchronous fast path an index may offer (the in-memory one does)."""

    def add_sync(self, pod: str, keys: list[int], tier: str = "GPU") -> None: ...
    def remove_sync(self, pod: str, keys: list[int], tier: str = "GPU") -> None: ...
    def clear_pod_sync(self, pod: str, tier: str | None = None) -> None: ...


class IndexOps:
    """Index writes produced by applying events, in order; consecutive writes of the
    same kind, pod and tier are merged into one call."""

    __slots__ = ("ops",)

    def __init__(self) -> None:
        #: (kind "add" | "remove" | "clear", pod, tier or None, keys)
        self.ops: list[tuple[str, str, str | None, list[int]]] = []

    def __len__(self) -> int:
        return len(self.ops)

    def _push(self, kind: str, pod: str, tier: str | None, keys: Iterable[int]) -> None:
        ops = self.ops
        if ops:
            k, p, t, ks = ops[-1]
            if k == kind and p == pod and t == tier and kind != "clear":
                ks.extend(keys)
                return
        ops.append((kind, pod, tier, list(keys)))

    def add(self, pod: str, tier: str, keys: Iterable[int]) -> None:
        self._push("add", pod, tier, keys)

    def remove(self, pod: str, tier: str, keys: Iterable[int]) -> None:
        self._push("remove", pod, tier, keys)

    def clear(self, pod: str) -> None:
        self._push("clear", pod, None, ())

    def extend(self, other: IndexOps) -> None:
        for kind, pod, tier, keys in other.ops:
            self._push(kind, pod, tier, keys)

    def apply_sync(self, index: SyncIndex) -> None:
        """Run the writes on an index with a synchronous fast path."""
        for kind, pod, tier, keys in self.ops:
            if kind == "add":
                if keys:
                    index.add_sync(pod, keys, tier)  # type: ignore[arg-type]
            elif kind == "remove":
                if keys:
                    index.remove_sync(pod, keys, tier)  # type: ignore[arg-type]
            else:
                index.clear_pod_sync(pod)

    async def apply(self, index: BlockIndex) -> None:
        """Run the writes on any index: in one call when it offers
        ``apply_ops(ops)`` (the Redis index: one round trip), else one awaited call per
        merged write."""
        if not self.ops:
            return
        apply_ops = getattr(index, "apply_ops", None)
        if apply_ops is not None:
            await apply_ops(self.ops)
            return
        for kind, pod, tier, keys in self.ops:
            if kind == "add":
                if keys:
                    await index.add(pod, keys, tier)  # type: ignore[arg-type]
            elif kind == "remove":
                if keys:
                    await index.remove(pod, keys, tier)  # type: ignore[arg-type]
            else:
                await index.clear_pod(pod)
