"""A chat's or an agent's next turn carries the previous answer, and the engine cached
that answer's blocks as it decoded it: the replay keys them as the next prompt does
(``TraceRequest.answer_keys``), so the next turn hits them on the pod that answered,
in both pod models and at the ceilings."""

from __future__ import annotations

import json
from itertools import pairwise
from pathlib import Path

from router.tokenize import ByteTokenizer
from scoring.policies import RouteRequest, build_policy
from scoring.replay.ceilings import infinite_ceiling, pooled_ceiling
from scoring.replay.engine import replay_policy
from scoring.replay.families import generate
from scoring.replay.presets import resolve_preset
from scoring.replay.simpod import FleetConfig
from scoring.replay.trace import Trace, TraceRequest, load_trace
from scoring.replay.vllm_pod import VllmFleetConfig

BS = 16


def sessions(trace: Trace) -> list[list[TraceRequest]]:
    """Each session's requests in arrival order."""
    out: dict[str, list[TraceRequest]] = {}
    for r in trace.requests:
        out.setdefault(r.route.session or "", []).append(r)
    return list(out.values())


def test_each_turn_carries_the_blocks_its_next_turn_holds_past_its_prompt() -> None:
    trace = generate("chat", 3, conversations=300, turns_median=4.0, block_size=BS)
    linked = 0
    for turns in sessions(trace):
        for a, b in pairwise(turns):
            full = a.prompt_tokens // BS
            end = min(len(b.route.block_keys), (a.prompt_tokens + a.output_tokens - 1) // BS)
            assert list(a.answer_keys) == list(b.route.block_keys[full:end])
            assert a.cached_keys() == list(b.route.block_keys[:end])  # a prefix of b
            linked += bool(a.answer_keys)
        assert not turns[-1].answer_keys  # nothing after it reads its answer
    assert linked > 50


def test_an_agent_that_compacts_starts_over_and_its_summary_is_never_read_back() -> None:
    """A compaction request's answer (the summary) starts a new chain after the system
    prompt: the next prompt does not go on from the compaction prompt, so it carries no
    answer keys; every other step's answer is read back by the next step."""
    trace = generate("agentic", 1, sessions=60, turns_median=15.0, block_size=64)
    starts_over = read_back = 0
    for turns in sessions(trace):
        for a, b in pairwise(turns):
            full = a.prompt_tokens // 64
            if list(b.route.block_keys[:full]) != list(a.route.block_keys[:full]):
                assert not a.answer_keys  # b started over (a compaction)
                starts_over += 1
            elif a.output_tokens > 64:
                assert a.answer_keys
                read_back += 1
    assert starts_over > 0 and read_back > 100


def two_turns(answer: bool) -> Trace:
    """One conversation, two turns 100 s apart: the second prompt is the first prompt
    (10 blocks), its 64-token answer (4 blocks) and a 2-block question."""
    first = list(range(10))
    second = [*first, 100, 101, 102, 103, 200, 201]

    def req(i: int, keys: list[int], output: int) -> RouteRequest:
        return RouteRequest(
            request_id=f"r{i}",
            model="m",
            prompt_tokens=len(keys) * BS,
            block_keys=keys,
            block_size=BS,
            session="c",
        )

    return Trace(
        requests=[
            TraceRequest(0.0, 65, req(0, first, 65), answer_keys=second[10:14] if answer else ()),
            TraceRequest(100.0, 8, req(1, second, 8)),
        ],
        block_size=BS,
        fmt="test",
    )


def second_turn_hit(trace: Trace, cfg: FleetConfig | VllmFleetConfig) -> int:
    run = replay_policy(trace, build_policy("round_robin"), cfg)  # one pod: both there
    return run.hit_tokens[1]


def test_the_next_turn_hits_the_answer_on_the_pod_that_decoded_it_in_both_models() -> None:
    simple = FleetConfig(pods=1, capacity_tokens=64 * BS, block_size=BS)
    engine = resolve_preset("cpu-tiny", {})  # the fleet sets its cache: 64 blocks
    vllm = VllmFleetConfig(pods=1, capacity_tokens=64 * BS, block_size=BS, engine=engine)
    for cfg in (simple, vllm):
        assert second_turn_hit(two_turns(answer=True), cfg) == 14 * BS  # prompt + answer
        assert second_turn_hit(two_turns(answer=False), cfg) == 10 * BS  # the prompt only


def test_the_ceilings_count_an_answer_read_back() -> None:
    assert infinite_ceiling(two_turns(answer=True)) == 14 / 26
    assert infinite_ceiling(two_turns(answer=False)) == 10 / 26
    assert pooled_ceiling(two_turns(answer=True), 64 * BS) == 14 / 26


def test_an_openai_trace_links_a_sessions_turns_through_the_answer_in_the_history(
    tmp_path: Path,
) -> None:
    """A captured chat (``session_id`` per line, ``answers_in_history``): the second
    body's history holds the first answer right after the first prompt, so the first
    request's answer keys are the second prompt's blocks there.  Without a session, or
    without the flag (a benchmark's histories carry answers of its own, not the pods'),
    nothing is linked."""
    first = [
        {"role": "system", "content": "You are a helpful assistant. " * 8},
        {"role": "user", "content": "Tell me about caches and prefixes and routers. " * 4},
    ]
    answer = "Caches keep blocks of tokens so that a later prompt can reuse them. " * 3
    second = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "?"}]
    output = len(answer.encode())  # the byte tokenizer: one token a byte

    def load(session: bool, answers: bool = True) -> Trace:
        path = tmp_path / f"chat-{session}.jsonl"
        lines = [(0, first, output), (1000, second, 8)]
        with path.open("w") as f:
            for ts, messages, out in lines:
                line: dict[str, object] = {"timestamp": ts, "output_length": out}
                line["body"] = {"model": "m", "messages": messages}
                if session:
                    line["session_id"] = "c1"
                f.write(json.dumps(line) + "\n")
        return load_trace(
            path, "openai", block_size=BS, tokenizer=ByteTokenizer(), answers_in_history=answers
        )

    a, b = load(session=True).requests
    end = (a.prompt_tokens + output - 1) // BS
    assert end - a.prompt_tokens // BS >= 10  # the answer fills 10+ blocks
    assert a.cached_keys() == list(b.route.block_keys[:end])
    assert not b.answer_keys
    assert all(not r.answer_keys for r in load(session=False).requests)
    assert all(not r.answer_keys for r in load(session=True, answers=False).requests)
