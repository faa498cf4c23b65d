"""Closed sessions in the replay: a session's next turn arrives after the answer to its
previous one, its planned think time later (scoring/replay/session_loop.py)."""

from __future__ import annotations

import dataclasses
import json
import math
from itertools import pairwise
from pathlib import Path

import pytest

from scoring.policies import RouteRequest, build_policy
from scoring.replay.cli import main
from scoring.replay.engine import PolicyRun, replay_policy
from scoring.replay.families import generate
from scoring.replay.presets import resolve_preset
from scoring.replay.session_loop import Arrivals
from scoring.replay.simpod import FleetConfig
from scoring.replay.trace import Trace, TraceRequest
from scoring.replay.vllm_pod import VllmFleetConfig
from tests.scoring.test_replay import conversations, write_jsonl

BS = 16


def agent_trace(**overrides: object) -> Trace:
    """Agent sessions with short think times: on a small fleet, later turns are planned
    before the answers to earlier ones can end."""
    return generate(
        "agentic",
        5,
        sessions=24,
        turns_median=6.0,
        think_s_median=0.5,
        block_size=BS,
        **overrides,
    )


def vllm_fleet(
    pods: int = 2, fast_forward: bool = True, preset: str = "llama3-8b-h100"
) -> VllmFleetConfig:
    engine = resolve_preset(preset, {})
    return VllmFleetConfig(
        pods=pods,
        capacity_tokens=8192 * BS,
        block_size=BS,
        engine=engine,
        fast_forward=fast_forward,
    )


def simple_fleet(pods: int = 2) -> FleetConfig:
    return FleetConfig(pods=pods, capacity_tokens=8192 * BS, block_size=BS)


def turns_of(trace: Trace) -> list[list[int]]:
    """Each session's request indices in trace order."""
    out: dict[str, list[int]] = {}
    for i, r in enumerate(trace.requests):
        if r.route.session is not None:
            out.setdefault(r.route.session, []).append(i)
    return list(out.values())


def early_turns(trace: Trace, run: PolicyRun) -> int:
    """Turns that arrived before the answer to their session's previous turn ended."""
    return sum(
        1
        for turns in turns_of(trace)
        for a, b in pairwise(turns)
        if run.arrival_s[b] < run.arrival_s[a] + run.e2e_s[a] - 1e-9
    )


@pytest.mark.parametrize("fleet", [vllm_fleet, simple_fleet], ids=["vllm", "simple"])
def test_a_closed_session_sends_each_turn_its_think_time_after_the_previous_answer(
    fleet: type,
) -> None:
    trace = agent_trace()
    run = replay_policy(trace, build_policy("round_robin"), fleet(), sessions="closed")
    pairs = 0
    for turns in turns_of(trace):
        first = turns[0]
        assert run.arrival_s[first] == trace.requests[first].arrival_s
        for a, b in pairwise(turns):
            think = trace.requests[b].arrival_s - trace.requests[a].arrival_s
            assert run.arrival_s[b] == pytest.approx(run.arrival_s[a] + run.e2e_s[a] + think)
            pairs += 1
    assert pairs > 50


def test_an_open_replay_sends_every_request_at_its_trace_time() -> None:
    trace = agent_trace()
    run = replay_policy(trace, build_policy("round_robin"), vllm_fleet())
    assert run.arrival_s == [r.arrival_s for r in trace.requests]


def test_on_a_fleet_that_falls_behind_only_the_open_replay_sends_turns_before_their_answers() -> (
    None
):
    trace = agent_trace()
    opened = replay_policy(trace, build_policy("round_robin"), vllm_fleet(pods=1))
    closed = replay_policy(
        trace, build_policy("round_robin"), vllm_fleet(pods=1), sessions="closed"
    )
    assert early_turns(trace, opened) > 10
    assert early_turns(trace, closed) == 0
    assert all(t == t for t in closed.ttft_s)  # every request answered


def test_stepping_over_decode_runs_gives_the_same_closed_replay_as_stepping_each_step() -> None:
    """A pod's run of decode steps may not pass an arrival; with closed sessions an
    arrival appears when an answer ends, so the run stops at the horizon: the earliest
    instant a turn not yet scheduled could arrive.  (The trace's times squeezed tenfold,
    so that answers end while other pods run: with each run planned only to the next
    planned arrival, 27 of its requests' first tokens differ.)"""
    trace = agent_trace()
    trace = dataclasses.replace(
        trace,
        requests=[dataclasses.replace(r, arrival_s=r.arrival_s / 10) for r in trace.requests],
    )
    runs = [
        replay_policy(trace, build_policy("cost"), vllm_fleet(fast_forward=ff), sessions="closed")
        for ff in (True, False)
    ]
    assert runs[0].arrival_s == pytest.approx(runs[1].arrival_s)
    assert runs[0].ttft_s == pytest.approx(runs[1].ttft_s)
    assert runs[0].pod_of == runs[1].pod_of


def request(i: int, blocks: int, session: str | None) -> RouteRequest:
    return RouteRequest(
        request_id=f"r{i}",
        model="m",
        prompt_tokens=blocks * BS,
        block_keys=[1000 * i + k for k in range(blocks)],
        block_size=BS,
        session=session,
    )


def test_requests_without_a_session_arrive_as_planned_when_sessions_are_closed() -> None:
    trace = Trace(
        requests=[
            TraceRequest(0.0, 400, request(0, 8, None)),
            TraceRequest(0.1, 400, request(1, 8, None)),
            TraceRequest(0.2, 400, request(2, 8, "s")),
            TraceRequest(0.3, 400, request(3, 8, "s")),
        ],
        block_size=BS,
        fmt="test",
    )
    run = replay_policy(trace, build_policy("round_robin"), vllm_fleet(pods=1), sessions="closed")
    assert run.arrival_s[:3] == [0.0, 0.1, 0.2]
    assert run.arrival_s[3] == pytest.approx(0.2 + run.e2e_s[2] + 0.1)
    assert run.arrival_s[3] > 0.3


def test_a_refused_turn_ends_at_once_and_the_next_turn_follows_it() -> None:
    fleet = vllm_fleet(pods=1, preset="cpu-tiny")
    too_long = fleet.engine.max_model_len // BS + 1  # vLLM refuses prompt >= max_model_len
    trace = Trace(
        requests=[
            TraceRequest(1.0, 4, request(0, too_long, "s")),
            TraceRequest(3.5, 4, request(1, 4, "s")),
        ],
        block_size=BS,
        fmt="test",
    )
    run = replay_policy(trace, build_policy("round_robin"), fleet, sessions="closed")
    assert run.rejected == 1 and math.isnan(run.ttft_s[0])
    assert run.arrival_s == [1.0, 3.5]  # refused at its arrival: the think time after it
    assert run.ttft_s[1] > 0


def test_a_mode_that_is_neither_open_nor_closed_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError, match=r"open, closed, got 'half'"):
        Arrivals(agent_trace().requests, "half")
    trace = write_jsonl(tmp_path / "t.jsonl", conversations())
    base = [str(trace), "--pods", "2", "--capacity-tokens", "32768", "--json", "--no-progress"]
    assert main([*base, "--policy", "cost", "--sessions", "closed"]) == 0
    assert json.loads(capsys.readouterr().out)["sessions"] == "closed"
    with pytest.raises(SystemExit) as exc:
        main([*base, "--sessions", "half"])
    assert exc.value.code == 2
    assert "invalid choice: 'half'" in capsys.readouterr().err


def test_the_horizon_is_the_next_arrival_or_the_soonest_a_waiting_turn_could_come() -> None:
    trace = dataclasses.replace(
        agent_trace(),
        requests=[
            TraceRequest(0.0, 4, request(0, 2, "a")),
            TraceRequest(5.0, 4, request(1, 2, None)),
            TraceRequest(0.7, 4, request(2, 2, "a")),  # think time 0.7 s after r0
        ],
    )
    arrivals = Arrivals(trace.requests, "closed")
    assert arrivals.next_time() == 0.0 and arrivals.pop() == 0
    assert arrivals.horizon(2.0) == pytest.approx(2.7)  # r0 may end now: r2 at 2.7
    arrivals.ended(0, 6.0)
    assert arrivals.horizon(6.0) == 5.0  # r1, planned
    assert arrivals.pop() == 1
    assert arrivals.next_time() == pytest.approx(6.7) and arrivals.pop() == 2
    assert arrivals.next_time() == math.inf


def test_the_matrix_replays_sessions_closed_unless_told_open(tmp_path: Path) -> None:
    from scoring.replay import matrix
    from tests.support.bench_module import load_bench

    cell = matrix.Cell("agentic", 4, "equal", "small", 1.1)
    default = matrix.run_cell(cell, 5, policies=["round_robin"], limit=120, pod_model="vllm")
    closed = matrix.run_cell(
        cell, 5, policies=["round_robin"], limit=120, pod_model="vllm", sessions="closed"
    )
    opened = matrix.run_cell(
        cell, 5, policies=["round_robin"], limit=120, pod_model="vllm", sessions="open"
    )
    assert default["sessions"] == "closed" and opened["sessions"] == "open"
    rows = (default["policies"]["round_robin"], closed["policies"]["round_robin"])
    assert [{k: v for k, v in r.items() if k != "replay_wall_s"} for r in rows] == [
        {k: v for k, v in rows[1].items() if k != "replay_wall_s"}
    ] * 2
    # on an overloaded cell the two modes replay different arrivals: different answers
    rr, rr_open = default["policies"]["round_robin"], opened["policies"]["round_robin"]
    assert rr["ttft_p90_s"] != rr_open["ttft_p90_s"]
    # the bench's run records the mode it replayed (a merge refuses to mix them)
    bench = load_bench("bench_quality_matrix")
    out = tmp_path / "run"
    args = ["--cells", "chat/p8-equal/medium/load80", "--limit", "30", "--policy", "cost"]
    assert bench.main([*args, "--out", str(out)]) == 0
    assert json.loads(out.with_suffix(".json").read_text())["run"]["sessions"] == "closed"
    assert "pod model `simpod`, sessions closed," in out.with_suffix(".md").read_text()
