"""RedisIndex's lookup walk against a reference model: random fleets, long runs of equal
hints with holes, slower tiers lacking block 0 (real server).
"""

from __future__ import annotations

import pytest

from scoring.index.redis import RedisIndex
from tests.scoring.redis_index_support import index as index  # the fixture


def reference_lookup(
    held: dict[tuple[str, str], dict[int, int]],
    tiers: tuple[str, ...],
    keys: list[int],
    pods: list[str] | None,
) -> dict[str, dict[str, int]]:
    """base.py's semantics, spelled out: leading blocks held in a tier <= t, per pod."""
    names = {p for p, _ in held} if pods is None else set(pods)
    out: dict[str, dict[str, int]] = {}
    for pod in names:
        hits = {}
        for ti, tier in enumerate(tiers):
            n = 0
            for k in keys:
                if not any(held.get((pod, t), {}).get(k, 0) > 0 for t in tiers[: ti + 1]):
                    break
                n += 1
            hits[tier] = n
        if hits[tiers[-1]] > 0:
            out[pod] = hits
    return out


class Mirrored:
    """Writes to the index, mirrored in ``held`` for :func:`reference_lookup`."""

    def __init__(self, index: RedisIndex) -> None:
        self.index = index
        self.held: dict[tuple[str, str], dict[int, int]] = {}

    async def add(self, pod: str, keys: list[int], tier: str) -> None:
        await self.index.add(pod, keys, tier)
        d = self.held.setdefault((pod, tier), {})
        for k in keys:
            d[k] = d.get(k, 0) + 1

    async def remove(self, pod: str, keys: list[int], tier: str) -> None:
        await self.index.remove(pod, keys, tier)
        d = self.held.setdefault((pod, tier), {})
        for k in keys:
            if d.get(k, 0) > 0:
                d[k] -= 1

    def expected(self, keys: list[int], pods: list[str] | None = None) -> dict[str, dict[str, int]]:
        return reference_lookup(self.held, self.index.tiers, keys, pods)


@pytest.mark.parametrize("seed", [1, 2, 3, 4, 5])
async def test_lookup_matches_the_reference_model(index: RedisIndex, seed: int) -> None:
    """Many pods share a prefix (runs of equal hints, whole chunks skipped), fewer go on;
    tiers mix, holes appear from removes, copies are counted."""
    import random

    rng = random.Random(seed)
    tiers = index.tiers
    chain = [rng.getrandbits(64) for _ in range(300)]
    pods = [f"pod-{i}" for i in range(20)]
    m = Mirrored(index)
    add, remove = m.add, m.remove

    if seed % 2:  # a run of identical holder sets (a system prompt on every pod)
        for pod in pods:
            await add(pod, chain[:24], "GPU")
        for pod in rng.sample(pods, 3):
            await add(pod, chain[: rng.randrange(5, 30)], "CPU")
    for pod in pods:
        await add(pod, chain[: rng.randrange(1, 40)], "GPU")
    for pod in rng.sample(pods, 6):
        await add(pod, chain[: rng.randrange(40, 300)], rng.choice(tiers))
    for pod in rng.sample(pods, 5):
        await add(pod, chain[rng.randrange(0, 60) : rng.randrange(60, 250)], "CPU")
    for pod in rng.sample(pods, 4):  # duplicate copies: one remove leaves one
        await add(pod, chain[:30], "GPU")
    for _ in range(25):
        pod, tier = rng.choice(pods), rng.choice(tiers)
        i = rng.randrange(0, 250)
        await remove(pod, chain[i : i + rng.randrange(1, 4)], tier)
    for query in (chain, chain[:50], chain[:1]):
        assert await index.lookup(query) == m.expected(query)
        cands = [*rng.sample(pods, 7), "pod-unknown"]  # fewer candidates than holders
        assert await index.lookup(query, cands) == m.expected(query, cands)
        many = [*rng.sample(pods, 15), *(f"ghost-{i}" for i in range(40))]  # more
        assert await index.lookup(query, many) == m.expected(query, many)
    await index.clear_pod(pods[0])
    for tier in tiers:
        m.held.pop((pods[0], tier), None)
    assert await index.lookup(chain) == m.expected(chain)


@pytest.mark.parametrize("hole", [0, 15, 16, 47, 48, 499, 1000, 1999])
async def test_long_runs_of_equal_hints_are_passed_by_chunk_yet_every_hole_is_found(
    index: RedisIndex, hole: int
) -> None:
    """A 2,000-block chain whose holder sets stay equal for hundreds of blocks (the walk
    passes whole chunks with one comparison); a single missing block anywhere -- first
    block of a chunk, last, middle -- still ends that pod's run, per tier."""
    chain = list(range(10_000, 12_000))
    m = Mirrored(index)
    await m.add("gpu-all", chain, "GPU")
    await m.add("holed", chain, "GPU")
    await m.add("two-tiers", chain[:1500], "GPU")  # one pod, two slots
    await m.add("two-tiers", chain, "CPU")
    await m.add("cpu-only", chain, "CPU")
    await m.remove("holed", [chain[hole]], "GPU")
    await m.remove("two-tiers", [chain[hole]], "CPU")  # the GPU copy still covers it
    expected = m.expected(chain)
    assert expected.get("holed", {}).get("GPU", 0) == hole
    assert expected["two-tiers"] == {
        "GPU": 1500,
        "CPU": 2000 if hole < 1500 else hole,
        "DISK": 2000 if hole < 1500 else hole,
    }
    assert await index.lookup(chain) == expected
    assert await index.lookup(chain, ["holed", "two-tiers"]) == {
        p: expected[p] for p in ("holed", "two-tiers") if p in expected
    }


@pytest.mark.parametrize("candidates", [None, ["pod-a"], ["pod-a", "pod-b", "pod-c", "pod-d"]])
async def test_a_slower_tier_lacking_block_0_still_extends_that_tiers_run(
    index: RedisIndex, candidates: list[str] | None
) -> None:
    """Block 0 only in GPU, blocks 1-9 only in CPU: the CPU (and DISK) run is 10 blocks,
    the GPU run 1 -- the CPU slot is found although block 0's hint does not name it.
    A pod whose run ended is not revived by a slot of it met further on."""
    chain = list(range(100, 110))
    await index.add("pod-a", chain[:1], "GPU")
    await index.add("pod-a", chain[1:], "CPU")
    await index.add("pod-b", chain[:2], "GPU")
    await index.add("pod-b", chain[3:], "CPU")  # block 2 held nowhere: run ends at 2
    hits = await index.lookup(chain, candidates)
    assert hits["pod-a"] == {"GPU": 1, "CPU": 10, "DISK": 10}
    if candidates is None or "pod-b" in candidates:
        assert hits["pod-b"] == {"GPU": 2, "CPU": 2, "DISK": 2}
    assert set(hits) <= {"pod-a", "pod-b"}
