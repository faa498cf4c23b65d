"""Synthetic traffic families, offered-load scaling and the benchmark matrix."""

from __future__ import annotations

import dataclasses
import math
from itertools import pairwise
from typing import Any

import pytest

from scoring.policies import build_policy
from scoring.replay.ceilings import infinite_ceiling
from scoring.replay.engine import replay_policy
from scoring.replay.families import (
    FAMILIES,
    Gamma,
    OnOff,
    Poisson,
    bursty,
    family_params,
    generate,
    interarrival_cv,
)
from scoring.replay.families import rag as rag_family
from scoring.replay.families.context import Context
from scoring.replay.matrix import Cell, add_ratios, quick_matrix, run_cell, select
from scoring.replay.matrix_report import CELL_COLUMNS, cell_table, summary_table
from scoring.replay.matrix_summary import summarize
from scoring.replay.offered_load import (
    offered_load,
    scale_to_load,
    span_s,
    uncached_tokens,
    working_set_tokens,
)
from scoring.replay.simpod import FleetConfig
from scoring.replay.trace import Trace, TraceRequest

SMALL: dict[str, dict[str, Any]] = {
    "agentic": {"sessions": 60, "turns_median": 15.0, "block_size": 64},
    "rag": {"requests": 300, "block_size": 64},
    "chat": {"conversations": 300, "turns_median": 4.0, "block_size": 64},
    "mixed": {"requests": 300, "block_size": 64},
}


def fingerprint(trace: Trace) -> list[tuple[float, int, int, tuple[int, ...], str | None]]:
    return [
        (r.arrival_s, r.prompt_tokens, r.output_tokens, tuple(r.route.block_keys), r.route.session)
        for r in trace.requests
    ]


def by_session(trace: Trace) -> dict[str, list[TraceRequest]]:
    out: dict[str, list[TraceRequest]] = {}
    for r in trace.requests:
        assert r.route.session is not None
        out.setdefault(r.route.session, []).append(r)
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# --- block keys of segment chains ---------------------------------------------------


def test_prompts_share_exactly_the_full_blocks_of_their_common_segments() -> None:
    a = Context(16).append(1, 100).append(2, 50)
    b = Context(16).append(1, 100).append(3, 50)
    assert len(a.keys) == 150 // 16
    assert common_prefix(a.keys, b.keys) == 100 // 16  # the block holding 96..111 differs


def test_appending_extends_the_chain_and_never_rekeys_earlier_blocks() -> None:
    ctx = Context(16).append(1, 40)
    before = list(ctx.keys)
    ctx.append(2, 40)
    assert ctx.keys[: len(before)] == before
    assert ctx.tokens == 80 and len(ctx.keys) == 5
    assert Context(16).append(1, 80).keys[:2] == before  # same segment, same keys


# --- every family ---------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_family_is_a_function_of_its_seed(name: str) -> None:
    one = generate(name, 3, **SMALL[name])
    again = generate(name, 3, **SMALL[name])
    other = generate(name, 4, **SMALL[name])
    assert fingerprint(one) == fingerprint(again)
    assert fingerprint(one) != fingerprint(other)
    assert one.fmt == f"synthetic:{name}" and one.block_size == 64
    assert [r.arrival_s for r in one.requests] == sorted(r.arrival_s for r in one.requests)
    assert all(len(r.route.block_keys) == r.prompt_tokens // 64 for r in one.requests)


def test_unknown_family_parameters_are_named() -> None:
    with pytest.raises(ValueError, match="turns_mean"):
        family_params("chat", turns_mean=3)
    with pytest.raises(ValueError, match="unknown family 'code'"):
        generate("code", 0)


# --- agentic --------------------------------------------------------------------------


def test_agentic_turns_append_to_the_previous_prompt_and_its_output() -> None:
    trace = generate("agentic", 0, **SMALL["agentic"])
    steps = 0
    for turns in by_session(trace).values():
        for prev, nxt in pairwise(turns):
            if nxt.prompt_tokens < prev.prompt_tokens:  # a compaction
                continue
            steps += 1
            k = len(prev.route.block_keys)
            assert list(nxt.route.block_keys[:k]) == list(prev.route.block_keys)
            assert nxt.prompt_tokens > prev.prompt_tokens + prev.output_tokens
            assert nxt.arrival_s > prev.arrival_s
    assert steps > 200


def test_agentic_prompts_are_over_nine_tenths_reusable() -> None:
    trace = generate("agentic", 0, **SMALL["agentic"])
    assert infinite_ceiling(trace) >= 0.9
    assert max(len(t) for t in by_session(trace).values()) >= 10  # tens of turns


def test_compaction_breaks_the_chain_after_the_system_prompt() -> None:
    p = {**SMALL["agentic"], "context_window_tokens": 24_000, "block_size": 16}
    trace = generate("agentic", 1, **p)
    p_system = family_params("agentic").system_prompt_tokens
    system_blocks = p_system // 16
    compactions = 0
    for turns in by_session(trace).values():
        for before, summary_call, after in zip(turns, turns[1:], turns[2:], strict=False):
            if after.prompt_tokens >= summary_call.prompt_tokens:
                continue
            compactions += 1
            # the summary request re-sends the whole context ...
            k = len(before.route.block_keys)
            assert list(summary_call.route.block_keys[:k]) == list(before.route.block_keys)
            # ... and what follows starts again from the system prompt alone
            shared = common_prefix(
                list(summary_call.route.block_keys), list(after.route.block_keys)
            )
            assert shared == system_blocks
            # the new context holds the system prompt and the summary that was asked for
            assert after.prompt_tokens > p_system + summary_call.output_tokens
    assert compactions >= 5


# --- rag, chat, mixed -----------------------------------------------------------------


def test_rag_requests_share_a_few_long_document_prefixes() -> None:
    p = family_params("rag", **SMALL["rag"])
    trace = rag_family.generate(p, 0)
    k = (p.system_prompt_tokens + 256) // 64  # every document is >= 256 tokens
    prefixes = {tuple(r.route.block_keys[:k]) for r in trace.requests}
    assert 1 < len(prefixes) <= p.docs
    assert infinite_ceiling(trace) > 0.9
    # the shared prefix is the document, not only its first blocks
    assert all(r.prompt_tokens >= p.system_prompt_tokens + 256 for r in trace.requests)


def test_chat_turns_share_a_few_system_prompts_and_their_history() -> None:
    p = family_params("chat", **SMALL["chat"])
    trace = generate("chat", 0, **SMALL["chat"])
    firsts = {r.route.block_keys[0] for r in trace.requests}
    assert len(firsts) <= p.system_prompts
    for turns in by_session(trace).values():
        for prev, nxt in pairwise(turns):
            k = len(prev.route.block_keys)
            assert list(nxt.route.block_keys[:k]) == list(prev.route.block_keys)


def test_mixed_prompts_are_mostly_short_with_a_long_fifth() -> None:
    trace = generate("mixed", 0, **SMALL["mixed"])
    long = sum(1 for r in trace.requests if r.prompt_tokens >= 4096 + 500)
    assert 0.1 < long / len(trace.requests) < 0.3
    assert infinite_ceiling(trace) < 0.3


# --- arrivals ---------------------------------------------------------------------------


def test_on_off_arrivals_are_bursty_and_poisson_ones_are_not() -> None:
    import random

    n = 3000
    assert 0.9 < interarrival_cv(Poisson(2.0).times(n, random.Random(0))) < 1.1
    assert interarrival_cv(OnOff(2.0).times(n, random.Random(0))) > 1.5
    assert interarrival_cv(Gamma(2.0, cv=3.0).times(n, random.Random(0))) > 2.0
    bursts = rag_family.generate(bursty(family_params("rag", **SMALL["rag"])), 0)
    assert interarrival_cv([r.arrival_s for r in bursts.requests]) > 1.5


def test_bursts_keep_the_mean_rate() -> None:
    import random

    times = OnOff(rate_per_s=2.0).times(20_000, random.Random(1))
    assert len(times) / times[-1] == pytest.approx(2.0, rel=0.1)


# --- offered load -------------------------------------------------------------------


def fleet(pods: int = 4, capacity: int = 200_000, **kw: object) -> FleetConfig:
    return FleetConfig(pods=pods, capacity_tokens=capacity, block_size=64, **kw)  # type: ignore[arg-type]


def test_scaling_hits_the_target_load_and_keeps_the_order() -> None:
    trace = generate("chat", 0, **SMALL["chat"])
    cfg = fleet()
    for target in (0.5, 0.8, 1.1):
        scaled, factor = scale_to_load(trace, cfg, target)
        assert offered_load(scaled, cfg) == pytest.approx(target, rel=1e-6)
        assert span_s(scaled) == pytest.approx(span_s(trace) * factor)
        assert [r.route for r in scaled.requests] == [r.route for r in trace.requests]
    assert offered_load(trace, cfg) != pytest.approx(0.8)  # the original is untouched


def test_the_work_at_a_ceiling_is_the_prompt_tokens_it_misses() -> None:
    trace = generate("chat", 0, **SMALL["chat"])
    prompt = sum(r.prompt_tokens for r in trace.requests)
    infinite = uncached_tokens(trace, None)
    assert infinite == pytest.approx(prompt * (1 - infinite_ceiling(trace)), rel=1e-9)
    assert infinite < uncached_tokens(trace, 20_000) < uncached_tokens(trace, 2_000)
    assert uncached_tokens(trace, 10 * working_set_tokens(trace)) == infinite


def test_a_router_at_the_ceiling_keeps_the_fleet_busy_for_the_offered_share() -> None:
    """The offered load is the prefill engines' busy share for a router that reaches the
    ceiling: ``mixed`` reuses only shared system prompts, which every policy hits."""
    trace = generate("mixed", 2, requests=600, block_size=64)
    cfg = fleet(capacity=400_000)
    scaled, _ = scale_to_load(trace, cfg, 0.6)
    run = replay_policy(scaled, build_policy("least_load"), cfg)
    busy = sum(run.busy_s) / (cfg.pods * span_s(scaled))
    assert busy == pytest.approx(0.6, rel=0.1)


# --- the matrix ---------------------------------------------------------------------


def test_cells_are_selected_by_glob() -> None:
    cells = quick_matrix()
    assert len(cells) == 14
    picked = select(cells, ["rag*/p8-*/*/load80"])
    assert [c.id for c in picked] == [
        "rag/p8-equal/medium/load80",
        "rag_bursty/p8-equal/medium/load80",
    ]
    assert select(cells, []) == cells


def test_a_tiny_matrix_reports_ratios_to_the_best_policy_in_the_cell() -> None:
    cell = Cell("chat", 4, "unequal", "medium", 0.8)
    r = run_cell(cell, 0, policies=["round_robin", "cost"], limit=300, block_size=64)
    assert r["cell"] == "chat/p4-unequal/medium/load80" and r["requests"] == 300
    caps = r["fleet"]["pod_capacity_tokens"]
    assert caps[0] == pytest.approx(2 * caps[1], rel=0.01) and caps[0] == caps[2]
    pols = r["policies"]
    assert set(pols) == {"round_robin", "cost"}
    for q in ("p50", "p90", "p99"):
        assert min(m[f"{q}_vs_best"] for m in pols.values()) == pytest.approx(1.0)
        for m in pols.values():
            best = min(x[f"ttft_{q}_s"] for x in pols.values())
            assert m[f"{q}_vs_best"] == pytest.approx(m[f"ttft_{q}_s"] / best)
    for m in pols.values():
        assert m["of_pooled"] == pytest.approx(m["hit_rate"] / r["ceilings"]["pooled"])
        # end to end: after the first token; the same ratio to the best as TTFT's
        assert m["e2e_p90_s"] > m["ttft_p90_s"] and m["json_e2e_p90_s"] is None
        best_e2e = min(x["e2e_p90_s"] for x in pols.values())
        assert m["e2e_p90_vs_best"] == pytest.approx(m["e2e_p90_s"] / best_e2e)

    table = cell_table([r]).splitlines()
    assert table[0] == "| " + " | ".join(CELL_COLUMNS) + " |"
    assert len(table) == 2 + 2
    assert all(row.count("|") == len(CELL_COLUMNS) + 1 for row in table)
    assert all(m["preemptions"] == 0 for m in pols.values())  # simpod: nothing preempts

    other = dataclasses.replace(cell, load=1.1)
    r2 = run_cell(other, 0, policies=["round_robin", "cost"], limit=300, block_size=64)
    summary = summarize([r, r2], seeds=[0])
    best = "round_robin" if pols["round_robin"]["p90_vs_best"] == 1.0 else "cost"
    assert summary["policies"][best]["tuning"]["within_1_05"] >= 1
    assert "held_out" not in summary["policies"][best]
    both = [x["policies"][best]["e2e_p90_vs_best"] for x in (r, r2)]
    assert summary["policies"][best]["tuning"]["e2e_p90_vs_best_geomean"] == pytest.approx(
        math.sqrt(both[0] * both[1])
    )
    assert summary_table(summary).splitlines()[0].startswith("| policy | p90/best geomean")


def test_the_summary_separates_the_tuning_seed_from_held_out_ones() -> None:
    def result(seed: int, ratio: float) -> dict[str, object]:
        r = {
            "cell": "x/p4-equal/small/load50",
            "seed": seed,
            "policies": {
                "a": {"ttft_p50_s": 1.0, "ttft_p90_s": 1.0, "ttft_p99_s": 1.0, "of_pooled": 1.0},
                "b": {
                    "ttft_p50_s": ratio,
                    "ttft_p90_s": ratio,
                    "ttft_p99_s": ratio,
                    "of_pooled": 0.5,
                },
            },
        }
        add_ratios(r)
        return r

    repeated = {**result(0, 9.0), "seed": 1, "same_as_seed": 0}  # a Mooncake cell
    runs = [result(0, 1.02), result(1, 4.0), result(2, 1.0), repeated]
    summary = summarize(runs, seeds=[0, 1, 2])
    b = summary["policies"]["b"]
    assert summary["seeds"] == {"tuning": 0, "held_out": [1, 2]}
    assert b["tuning"]["within_1_05"] == 1 and b["tuning"]["cells"] == 1
    assert b["held_out"]["p90_vs_best_geomean"] == pytest.approx(2.0)
    assert b["held_out"]["worst_p90_vs_best"] == pytest.approx(4.0)
    assert b["held_out"]["worst_cell"] == "x/p4-equal/small/load50 (seed 1)"
    assert b["all"]["cells"] == 3
    # runs from before the replay timed answers' ends have no end-to-end figures
    assert b["all"]["e2e_p90_vs_best_geomean"] is None


def test_a_variant_is_a_policy_under_other_parameters_reported_as_its_own_row() -> None:
    from scoring.replay.matrix import parse_variant

    assert parse_variant("old=cost:backlog_unit=prompt,backlog_weight=12") == (
        "old",
        "cost",
        {"backlog_unit": "prompt", "backlog_weight": 12},
    )
    cell = Cell("chat", 4, "equal", "medium", 0.8)
    r = run_cell(
        cell,
        0,
        policies=["cost"],
        variants=["same=cost:", "old=cost:backlog_unit=prompt"],
        limit=200,
        block_size=64,
    )
    pols = r["policies"]
    assert set(pols) == {"cost", "same", "old"}
    # a variant with no parameters is the policy itself: the replay is deterministic
    assert {k: v for k, v in pols["same"].items() if k != "replay_wall_s"} == {
        k: v for k, v in pols["cost"].items() if k != "replay_wall_s"
    }


@pytest.mark.parametrize(
    "spec, problem",
    [
        ("cost:backlog_unit=prompt", "expected LABEL=POLICY"),
        ("cost=cost:backlog_unit=prompt", "is a policy's name"),
        ("x=cost:backlog_unit", "is not KEY=VALUE"),
        ("x=nope:", "unknown policy 'nope'"),
        ("x=cost:backlog_unit=bytes", "backlog_unit"),
    ],
)
def test_a_bad_variant_is_refused_with_what_is_wrong(spec: str, problem: str) -> None:
    from scoring.replay.matrix import parse_variant

    with pytest.raises(ValueError, match=problem):
        parse_variant(spec)
