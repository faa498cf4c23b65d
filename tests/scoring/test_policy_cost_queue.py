"""``cost`` counts only the cached prefix that survives until the request's prefill.
vLLM serves a pod's queue FCFS and evicts LRU, so the blocks touched after the prefix
was last touched push its tail out of a cache too small for both.  With hot tracking
(the default) that is every block routed to the pod since the prefix was last routed
there (scoring/policies/hot_set.py, ``lru_evictions``); without it, the blocks of the
requests queued ahead (scoring/policies/queued.py, ``queue_evictions``)."""

from __future__ import annotations

from scoring.policies import PodView, RouteRequest, build_policy
from scoring.policies.cost import CostPolicy
from scoring.policies.queued import QueuedPrompts
from tests.support.clock import ManualClock

BS = 16
SYSTEM = [1, 2]  # a shared instruction: two blocks every prompt starts with


def chain(doc: int, blocks: int, question: int | None = None) -> list[int]:
    """A chain of block keys: the instruction, ``blocks`` of document ``doc``, and one
    block of question ``question``."""
    keys = SYSTEM + [doc * 1000 + i for i in range(blocks)]
    if question is not None:
        keys.append(doc * 1000 + 900 + question)
    return keys


def req(rid: str, keys: list[int]) -> RouteRequest:
    return RouteRequest(
        request_id=rid, model="m", prompt_tokens=len(keys) * BS, block_keys=keys, block_size=BS
    )


# --- the queue's arithmetic --------------------------------------------------------------


def test_an_empty_queue_leaves_the_cached_prefix_whole() -> None:
    q = QueuedPrompts()
    assert q.surviving("p", chain(1, 20), cached=22, capacity=30) == 22


def test_prompts_queued_after_the_prefix_push_its_tail_out_of_a_small_cache() -> None:
    q = QueuedPrompts()
    q.add("p", "e", chain(2, 15, question=0))  # 2 shared + 16 of its own blocks
    # 30 blocks of cache, 16 will be touched after the prefix: 14 of its 22 blocks stay
    assert q.surviving("p", chain(1, 20), cached=22, capacity=30) == 14
    # a cache large enough for both keeps it all
    assert q.surviving("p", chain(1, 20), cached=22, capacity=38) == 22
    # and one the queue alone fills keeps none
    assert q.surviving("p", chain(1, 20), cached=22, capacity=16) == 0


def test_a_queued_carrier_touches_the_prefix_after_everything_queued_before_it() -> None:
    q = QueuedPrompts()
    q.add("p", "e", chain(2, 15, question=0))
    q.add("p", "d", chain(1, 20, question=0))  # the same document, queued last
    assert q.surviving("p", chain(1, 20, question=1), cached=22, capacity=30) == 22
    q.add("p", "e2", chain(2, 15, question=1))  # queued after the carrier
    assert q.surviving("p", chain(1, 20, question=1), cached=22, capacity=30) == 14


def test_queued_prompts_over_one_document_count_its_blocks_once() -> None:
    q = QueuedPrompts()
    for i in range(5):  # five questions over document 2: 15 blocks + 5 questions
        q.add("p", f"e{i}", chain(2, 15, question=i))
    # each leaves this prompt at the same block with the same key: the longest counts
    # (16 blocks, where counting each prompt would be 80 and leave nothing)
    assert q.surviving("p", chain(1, 20), cached=22, capacity=30) == 30 - 16


def test_a_request_leaves_the_queue_when_it_starts_decoding_or_ends() -> None:
    q = QueuedPrompts()
    q.add("p", "e", chain(2, 15, question=0))
    q.remove("e")
    assert q.surviving("p", chain(1, 20), cached=22, capacity=30) == 22
    q.remove("never-added")  # nothing there: no error
    q.add("p", "e", chain(2, 15, question=0))
    q.add("other", "e", chain(2, 15, question=0))  # routed again: it left p's queue
    assert q.surviving("p", chain(1, 20), cached=22, capacity=30) == 22
    assert q.surviving("other", chain(1, 20), cached=22, capacity=30) == 14
    q.add("p", "e", chain(2, 15, question=0))
    q.forget("p")
    assert q.surviving("p", chain(1, 20), cached=22, capacity=30) == 22


# --- the policy ------------------------------------------------------------------------


def two_pods(cached_on_a: int) -> list[PodView]:
    """Pod ``a`` holds ``cached_on_a`` leading blocks of the prompt and has one 17-block
    prompt queued; pod ``b`` holds nothing and is idle.  Both caches: 30 blocks."""
    return [
        PodView(
            pod="a",
            hits={"GPU": cached_on_a},
            outstanding_prefill_tokens=17 * BS,
            capacity_blocks=30,
            kv_usage=0.0,
        ),
        PodView(pod="b", capacity_blocks=30, kv_usage=0.0),
    ]


def policy(**params: object) -> CostPolicy:
    """``cost`` with the queue rule alone (the fallback when hot tracking is off), unless
    ``params`` say otherwise."""
    p = build_policy(
        "cost", {"prefill_rate_tokens_per_s": 1000.0, "lru_evictions": False, **params}
    )
    assert isinstance(p, CostPolicy)
    p.clock = ManualClock(1000.0, step=0.001)
    return p


def test_a_hit_the_queue_ahead_will_evict_is_priced_as_the_miss_it_becomes() -> None:
    p = policy()
    p.on_routed(req("other-doc", chain(2, 15, question=0)), "a")  # queued on a
    d = p.pick(req("d", chain(1, 20)), two_pods(cached_on_a=22))
    assert d.detail["cached_tokens"]["a"] == 14 * BS
    assert d.pod == "b"  # a: 17 blocks queued + 8 to recompute; b: 22 to compute
    # without either rule the whole prefix counts and the queued pod wins
    off = policy(queue_evictions=False)
    off.on_routed(req("other-doc", chain(2, 15, question=0)), "a")
    d_off = off.pick(req("d", chain(1, 20)), two_pods(cached_on_a=22))
    assert (d_off.pod, d_off.detail["cached_tokens"]["a"]) == ("a", 22 * BS)


def test_once_the_request_ahead_is_decoding_its_blocks_are_touched_and_the_hit_is_safe() -> None:
    p = policy()
    ahead = req("other-doc", chain(2, 15, question=0))
    p.on_routed(ahead, "a")
    p.on_first_token(ahead, "a", 0.5)  # prefilled: what it evicted, the index shows
    d = p.pick(req("d", chain(1, 20)), two_pods(cached_on_a=22))
    assert d.detail["cached_tokens"]["a"] == 22 * BS
    assert d.pod == "a"


def test_a_completed_or_rerouted_request_no_longer_counts() -> None:
    p = policy()
    ahead = req("other-doc", chain(2, 15, question=0))
    p.on_routed(ahead, "a")
    p.on_routed(ahead, "b")  # retried elsewhere: it is no longer queued on a
    assert p.pick(req("d", chain(1, 20)), two_pods(cached_on_a=22)).detail["cached_tokens"][
        "a"
    ] == (22 * BS)
    p.on_complete(ahead, "b")
    p.on_routed(ahead, "a")
    p.on_complete(ahead, "a")  # failed before its first token
    assert p.pick(req("d2", chain(1, 20)), two_pods(cached_on_a=22)).detail["cached_tokens"][
        "a"
    ] == (22 * BS)


def test_a_pod_of_unknown_capacity_keeps_the_index_hits() -> None:
    p = policy()
    p.on_routed(req("other-doc", chain(2, 15, question=0)), "a")
    views = [PodView(pod="a", hits={"GPU": 22}, outstanding_prefill_tokens=17 * BS)]
    assert p.pick(req("d", chain(1, 20)), views).detail["cached_tokens"]["a"] == 22 * BS


def test_a_removed_pod_takes_its_queue_with_it() -> None:
    p = policy()
    p.on_routed(req("other-doc", chain(2, 15, question=0)), "a")
    p.on_pod_removed("a")
    assert p.pick(req("d", chain(1, 20)), two_pods(cached_on_a=22)).detail["cached_tokens"][
        "a"
    ] == (22 * BS)


# --- LRU distance (the default, with hot tracking) -----------------------------------------


def lru(**params: object) -> CostPolicy:
    return policy(lru_evictions=True, **params)


def test_blocks_routed_after_the_prefix_count_even_once_they_have_run() -> None:
    p = lru()
    d_first = req("d-first", chain(1, 20, question=0))
    p.on_routed(d_first, "a")
    p.on_first_token(d_first, "a", 0.1)
    p.on_complete(d_first, "a")
    other = req("other-doc", chain(2, 15, question=0))
    p.on_routed(other, "a")
    p.on_first_token(other, "a", 0.1)
    p.on_complete(other, "a")  # nothing is queued on a any more ...
    d = p.pick(req("d", chain(1, 20, question=1)), two_pods(cached_on_a=22))
    # ... but its 16 blocks are newer than document 1's in a's LRU: 30 - 16 of 22 stay
    assert d.detail["cached_tokens"]["a"] == 14 * BS
    # the queue rule alone sees an empty queue and counts them all
    queue_only = policy()
    for r in (d_first, other):
        queue_only.on_routed(r, "a")
        queue_only.on_first_token(r, "a", 0.1)
    assert queue_only.pick(req("d2", chain(1, 20, question=1)), two_pods(22)).detail[
        "cached_tokens"
    ]["a"] == (22 * BS)


def test_a_prefix_routed_again_after_the_others_is_the_newest_and_stays_whole() -> None:
    p = lru()
    p.on_routed(req("other-doc", chain(2, 15, question=0)), "a")
    p.on_routed(req("d-again", chain(1, 20, question=0)), "a")
    d = p.pick(req("d", chain(1, 20, question=1)), two_pods(cached_on_a=22))
    assert d.detail["cached_tokens"]["a"] == 22 * BS


def test_a_prefix_this_router_never_sent_is_older_than_everything_it_sent() -> None:
    p = lru()
    p.on_routed(req("other-doc", chain(2, 15, question=0)), "a")
    p.on_routed(req("third-doc", chain(3, 5, question=0)), "a")
    # document 1 is cached on a (the index says so) but was not routed there lately:
    # both documents' own blocks (16 + 6) are newer; the shared instruction is its own
    d = p.pick(req("d", chain(1, 20)), two_pods(cached_on_a=22))
    assert d.detail["cached_tokens"]["a"] == (30 - 22) * BS


def test_the_next_turn_of_a_chat_counts_the_answer_the_pod_cached_as_routed_with_it() -> None:
    """The pod caches a turn's answer as it decodes it, so the next turn hits a block
    more than was routed.  Only what was routed after the turn is newer (here the other
    document's 16 blocks): 30 - 16 = 14 of its 24 cached blocks stay, as if the answer
    had been routed too (counted as never routed there, the older document's 16 blocks
    would be newer as well, and none would stay)."""
    p = lru()
    p.on_routed(req("older-doc", chain(3, 15, question=0)), "a")  # before the turn
    turn = chain(1, 20, question=0)  # 23 blocks routed to a
    p.on_routed(req("turn-1", turn), "a")
    p.on_routed(req("other-doc", chain(2, 15, question=0)), "a")
    next_turn = [*turn, 5000, 5001]  # block 5000: the answer, cached by a
    d = p.pick(req("turn-2", next_turn), two_pods(cached_on_a=24))
    assert d.detail["cached_tokens"]["a"] == 14 * BS
    # a prefix that leaves a routed prompt partway is older than everything routed past
    # the point where it leaves: the instruction (routed again by every prompt) and
    # document 1's first block stay, its own block after them does not
    d = p.pick(req("edit", [*SYSTEM, 1000, 7777, 7778]), two_pods(cached_on_a=4))
    assert d.detail["cached_tokens"]["a"] == 3 * BS


def test_without_hot_tracking_the_queue_rule_applies() -> None:
    p = lru(hot_window_s=0)
    ahead = req("other-doc", chain(2, 15, question=0))
    p.on_routed(ahead, "a")
    assert p.pick(req("d", chain(1, 20)), two_pods(22)).detail["cached_tokens"]["a"] == 14 * BS
    p.on_first_token(ahead, "a", 0.1)
    assert p.pick(req("d2", chain(1, 20)), two_pods(22)).detail["cached_tokens"]["a"] == 22 * BS
