"""What a policy remembers of its own routing, at a cost that does not grow with the
prompt: the live requests' prefixes per pod (scoring/policies/inflight.py) and the hot
set (scoring/policies/hot_set.py)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator

from scoring.blocks import BlockHasher
from scoring.policies.hot_set import HotBlocks
from scoring.policies.inflight import InflightPrefixes, shared_blocks

HASHER = BlockHasher(4, "m")


def chain(tokens: list[int]) -> list[int]:
    return HASHER.keys(tokens)


def linear_shared(a: list[int], b: list[int]) -> int:
    """The common prefix by a linear scan."""
    pairs = enumerate(zip(a, b, strict=False))
    return next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))


def test_shared_blocks_is_the_common_prefix_of_two_chains() -> None:
    rng = random.Random(5)
    base = [rng.randrange(1000) for _ in range(400)]
    whole = chain(base)
    for _ in range(300):
        cut = rng.randrange(0, 401)
        other = base[:cut] + [rng.randrange(1000, 2000) for _ in range(rng.randrange(0, 80))]
        keys = chain(other)
        assert shared_blocks(whole, keys) == linear_shared(whole, keys)
        assert shared_blocks(keys, whole) == linear_shared(whole, keys)
    assert shared_blocks([], whole) == 0
    assert shared_blocks(whole, whole) == len(whole)


def test_a_pod_carries_the_longest_prefix_of_its_live_requests() -> None:
    live = InflightPrefixes()
    system = list(range(64))
    a = chain(system + [1000 + i for i in range(40)])
    b = chain(system + [2000 + i for i in range(80)])
    live.add("p0", a)
    live.add("p0", b)
    live.add("p1", chain([7] * 32))
    turn = chain(system + [2000 + i for i in range(60)] + [9] * 8)
    assert live.hits("p0", turn) == 16 + 15  # the system prompt and b's first 60 tokens
    assert live.hits("p1", turn) == 0  # another first block
    assert live.hits("p2", turn) == 0  # nothing routed there
    live.remove("p0", b)
    assert live.hits("p0", turn) == 16  # only a's system prompt is left
    live.remove("p0", list(a))  # an equal chain, not the same object
    assert live.hits("p0", turn) == 0 and not live.has("p0")
    live.remove("p0", a)  # completing twice is harmless
    live.forget("p1")
    assert not live.has("p1")


def test_two_live_requests_with_one_prompt_count_until_both_complete() -> None:
    live = InflightPrefixes()
    keys = chain(list(range(40)))
    first, second = list(keys), list(keys)
    live.add("p", first)
    live.add("p", second)
    live.remove("p", first)
    assert live.hits("p", keys) == len(keys)
    live.remove("p", second)
    assert live.hits("p", keys) == 0


def test_a_hot_key_routed_again_stays_when_its_first_routing_leaves_the_window() -> None:
    hot = HotBlocks(window_s=10.0)
    hot.routed("p", [1, 2, 3], now=0.0)
    hot.routed("p", [1, 2, 9], now=6.0)
    assert hot.count("p", now=7.0) == 4
    assert hot.count("p", now=11.0) == 3  # 3 left with the first request; 1, 2 refreshed
    assert hot.count("p", now=17.0) == 0


def test_a_prompt_routed_again_or_cut_short_refreshes_only_its_own_blocks() -> None:
    hot = HotBlocks(window_s=10.0)
    long = chain(list(range(40)))  # 10 blocks
    hot.routed("p", long, now=0.0)
    hot.routed("p", long[:4], now=5.0)  # a shorter prompt: its 4 blocks refreshed
    hot.routed("p", chain(list(range(8)) + [99] * 8), now=6.0)  # 2 shared + 2 new
    assert hot.count("p", now=6.0) == 12
    assert hot.count("p", now=12.0) == 6  # the long prompt's last 6 blocks left
    hot.routed("p", long, now=13.0)
    assert hot.count("p", now=14.0) == 12
    assert hot.count("p", now=24.0) == 0


def prompts(rng: random.Random) -> Callable[[], list[int]]:
    """Random prompts over four shared heads, cut at random lengths."""
    heads = [[rng.randrange(1 << 20) for _ in range(rng.randrange(8, 64))] for _ in range(4)]

    def prompt() -> list[int]:
        tokens = rng.choice(heads) + [rng.randrange(1 << 20) for _ in range(rng.randrange(0, 40))]
        return chain(tokens)[: rng.randrange(1, 40)]

    return prompt


def routed_then_queried(
    rng: random.Random, *, pauses: bool, steps: int = 300
) -> Iterator[tuple[HotBlocks, float, dict[int, float], list[int]]]:
    """Route a random prompt to pod ``p`` of a 50 s hot set at increasing times (now and
    then after a pause), then yield the hot set, the time, each key's last routing time
    and a random query prompt."""
    prompt = prompts(rng)
    hot = HotBlocks(window_s=50.0)
    last: dict[int, float] = {}
    now = 0.0
    for _ in range(steps):
        now += rng.random() * 2
        if pauses:
            now += rng.random() * 30 if rng.random() < 0.05 else 0.0
        keys = prompt()
        hot.routed("p", keys, now)
        last.update(dict.fromkeys(keys, now))
        yield hot, now, last, prompt()


def test_the_hot_set_counts_what_a_dictionary_of_keys_would() -> None:
    """Many prompts over a few shared prefixes, some repeated, some cut short, at
    increasing times: the tree's count equals the distinct keys routed in the window."""
    rng = random.Random(11)
    heads = [[rng.randrange(1 << 20) for _ in range(rng.randrange(8, 64))] for _ in range(4)]
    hot = HotBlocks(window_s=50.0)
    bounded = HotBlocks(window_s=50.0)  # capacity 30 blocks: counts at most 60
    last: dict[int, float] = {}
    now = 0.0
    for _ in range(400):
        now += rng.random() * 2
        tokens = rng.choice(heads) + [rng.randrange(1 << 20) for _ in range(rng.randrange(0, 40))]
        keys = chain(tokens)[: rng.randrange(1, 40)]
        hot.routed("p", keys, now)
        bounded.routed("p", keys, now, capacity=30)
        last.update(dict.fromkeys(keys, now))
        now += rng.random() * 20 if rng.random() < 0.1 else 0.0  # now and then a pause
        distinct = sum(1 for t in last.values() if t >= now - 50.0)
        assert hot.count("p", now) == distinct
        assert bounded.count("p", now) == min(distinct, 60)


def test_a_routed_prefix_is_the_leading_keys_a_dictionary_of_keys_holds_in_the_window() -> None:
    """``prefix``: the leading blocks of a prompt routed to the pod within the window
    (what the router falls back on while the shared index cannot be read)."""
    partial = 0
    for hot, now, last, query in routed_then_queried(random.Random(13), pauses=True):
        window = {k for k, t in last.items() if t >= now - 50.0}
        expected = next((i for i, k in enumerate(query) if k not in window), len(query))
        assert hot.prefix("p", query, now) == expected
        assert hot.prefix("q", query, now) == 0  # nothing routed to that pod
        partial += 0 < expected < len(query)
    assert partial > 10  # prompts that share only a prefix with what was routed


def test_a_hot_set_past_its_bound_counts_the_bound_and_keeps_bounded_memory() -> None:
    hot = HotBlocks(window_s=1e9)
    for i in range(100):
        hot.routed("p", list(range(i * 10, i * 10 + 10)), now=float(i), capacity=50)
    assert hot.count("p", now=100.0) == 100  # twice the capacity
    assert hot._pods["p"].keys <= 100 + 10  # the bound plus at most one request's keys


def test_a_conversation_growing_turn_by_turn_stays_one_branch_of_the_tree() -> None:
    hot = HotBlocks(window_s=1e9)
    tokens: list[int] = []
    for turn in range(30):
        tokens += [turn] * 16 + [1000 + turn] * 16  # the answer and the next message
        hot.routed("p", chain(tokens), now=float(turn))
    root = hot._pods["p"].root
    assert len(root.children) == 1 and not next(iter(root.children.values())).children
    assert hot.count("p", now=30.0) == len(chain(tokens))


def test_a_prompt_routed_again_and_again_keeps_one_entry_per_node() -> None:
    hot = HotBlocks(window_s=300.0)
    keys = chain(list(range(64)))
    for i in range(1000):
        hot.routed("p", keys, now=float(i) / 100)
    tree = hot._pods["p"]
    assert len(tree.order) == 1 and hot.count("p", now=10.0) == len(keys)


def test_a_chats_answer_cached_by_its_pod_is_as_recent_as_the_turn_before_it() -> None:
    """The pod caches a turn's answer as it decodes it, so the next turn hits one block
    more than was routed.  That block is as recent as the turn (the end of a routed
    chain), not older than everything routed (which predicted a nearly full pod had
    evicted it, and sent the conversation away from the pod holding it)."""
    hot = HotBlocks(window_s=1e9)
    hot.routed("p", list(range(2000, 2300)), now=0.5)  # older traffic
    turn = list(range(100))
    hot.routed("p", turn, now=1.0)
    hot.routed("p", list(range(1000, 1050)), now=2.0)  # another conversation, after it
    next_turn = [*turn, 100, 101, 102]  # block 100: the answer, cached by the pod
    # 50 keys are newer than the turn: blocks 0..149 of it would stay in 200
    assert hot.surviving("p", next_turn, 101, now=3.0, capacity=200) == 101
    assert hot.surviving("p", next_turn, 101, now=3.0, capacity=120) == 70
    # one that leaves a routed chain where another chain goes on: past the point where
    # it leaves, older than every routed key (300 + 50 + 2 of them)
    hot.routed("p", [*turn, 7000, 7001], now=4.0)  # a second branch after block 99
    assert hot.surviving("p", next_turn, 101, now=5.0, capacity=200) == 100
    assert hot.surviving("p", next_turn, 101, now=5.0, capacity=451) == 100
    assert hot.surviving("p", next_turn, 101, now=5.0, capacity=453) == 101


def test_the_blocks_an_lru_cache_keeps_are_what_a_dictionary_of_keys_says() -> None:
    """``surviving``: block ``i`` of the cached prefix stays while ``i`` + the keys routed
    strictly after it (each block its own last routing time: a shared head routed again
    is recent), less the prompt's own, stay under the capacity; a block not in the window
    is older than every key in it."""
    rng = random.Random(14)
    checked = partial = 0
    for hot, now, last, query in routed_then_queried(rng, pauses=False):
        cached = rng.randrange(1, len(query) + 1)
        window = {k: t for k, t in last.items() if t >= now - 50.0}
        own = set(query[:cached])
        others = [t for k, t in window.items() if k not in own]
        for capacity in (5, 20, 60):
            expected = cached
            for i, k in enumerate(query[:cached]):
                t = window.get(k)
                newer = len(others) if t is None else sum(1 for u in others if u > t)
                if i + newer >= capacity:
                    expected = i
                    break
            assert hot.surviving("p", query, cached, now, capacity) == expected
            checked += 1
            partial += 0 < expected < cached
    assert checked > 500 and partial > 20
