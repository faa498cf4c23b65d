"""The prefixes of the requests a policy routed that are still running, per pod.

A request queued behind an earlier one on the same pod (vLLM schedules FCFS) finds
the earlier request's blocks computed when it runs, although the index only learns
them once the engine stores them.  :class:`InflightPrefixes` answers "how many leading
blocks of this prompt do the live requests routed to this pod carry?".

Block keys are chains (:mod:`scoring.blocks`): key ``i`` hashes key ``i - 1`` and the
block's tokens, so two chains that agree at position ``i`` agree at every position
before it.  So the leading blocks a live chain shares with a prompt are found by a
binary search on the position of the last equal key, and the leading blocks the union
of the live chains carries are the longest of those.  Only chains that start with the
prompt's first key can share anything, so a pod's chains are grouped by their first
key.  Routing and completing a request cost a dictionary update, whatever its
length; a lookup costs ``log2(blocks)`` comparisons per live chain that shares the
first block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def agree_until(a: Sequence[int], b: Sequence[int], lo: int, hi: int) -> int:
    """The end of the run from ``lo`` where chains ``a`` and ``b`` agree, given
    ``a[lo] == b[lo]`` and ``hi <= min(len(a), len(b))`` (binary search: chains that
    agree at a position agree at every one before it)."""
    if a[hi - 1] == b[hi - 1]:
        return hi
    lo += 1  # a[:lo] == b[:lo]; a[hi - 1] != b[hi - 1]
    hi -= 1
    while lo < hi:  # invariant: the answer is in [lo, hi]
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def shared_blocks(chain: Sequence[int], keys: Sequence[int]) -> int:
    """Leading blocks ``chain`` and ``keys`` have in common (both chains of block keys
    from the same root; 0 when their first keys differ)."""
    hi = min(len(chain), len(keys))
    if hi == 0 or chain[0] != keys[0]:
        return 0
    return agree_until(chain, keys, 0, hi)


class InflightPrefixes:
    """Per pod, the block-key chains of its live requests, grouped by first key (each
    group: ``id(chain) -> [chain, how many live requests carry that object]``)."""

    __slots__ = ("pods",)

    def __init__(self) -> None:
        #: pod -> first key -> group (read-only outside: a pod absent carries nothing)
        self.pods: dict[str, dict[int, dict[int, list[Any]]]] = {}

    def add(self, pod: str, keys: Sequence[int]) -> None:
        """A request carrying ``keys`` was routed to ``pod``."""
        if keys:
            group = self.pods.setdefault(pod, {}).setdefault(keys[0], {})
            entry = group.get(id(keys))
            if entry is None:
                group[id(keys)] = [keys, 1]
            else:
                entry[1] += 1

    def remove(self, pod: str, keys: Sequence[int]) -> None:
        """A request :meth:`add` recorded on ``pod`` completed (the same ``keys`` object,
        else an equal chain; nothing when it is not there)."""
        groups = self.pods.get(pod)
        if not keys or groups is None:
            return
        group = groups.get(keys[0])
        if group is None:
            return
        at = id(keys)  # a recorded chain is alive (the group holds it): its id is its own
        entry = group.get(at)
        if entry is None:
            at = next((i for i, (chain, _) in group.items() if chain == keys), 0)
            entry = group.get(at)
            if entry is None:
                return
        entry[1] -= 1
        if entry[1] <= 0:
            del group[at]
            if not group:
                del groups[keys[0]]
                if not groups:
                    del self.pods[pod]

    def hits(self, pod: str, keys: Sequence[int]) -> int:
        """Leading blocks of ``keys`` that the live requests routed to ``pod`` carry."""
        groups = self.pods.get(pod)
        if not keys or groups is None:
            return 0
        group = groups.get(keys[0])
        if group is None:
            return 0
        n = len(keys)
        best = 0
        for chain, _ in group.values():
            s = shared_blocks(chain, keys)
            if s > best:
                best = s
                if s == n:
                    break
        return best

    def has(self, pod: str) -> bool:
        """Whether any live request routed to ``pod`` carries a block."""
        return pod in self.pods

    def forget(self, pod: str) -> None:
        self.pods.pop(pod, None)
