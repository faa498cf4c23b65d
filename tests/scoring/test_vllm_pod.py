"""The vLLM-like pod model: scheduler, KV blocks, step costs, presets, replay, CLI."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from scoring.policies import build_policy
from scoring.policies.cost_params import CostParams
from scoring.policies.registry import available_policies
from scoring.replay.cli import main
from scoring.replay.engine import PolicyRun, replay_policy
from scoring.replay.fleet_args import fleet_defaults
from scoring.replay.kv_blocks import BlockPool
from scoring.replay.presets import PRESETS, EngineSpec, PresetError, resolve_preset
from scoring.replay.report import summarize
from scoring.replay.step_cost import StepCost, StepWork, prefill_pairs
from scoring.replay.trace import load_trace
from scoring.replay.vllm_pod import VllmFleetConfig
from scoring.replay.vllm_sched import Scheduler, Seq, StepPlan, StepResult

# one second per step plus a millisecond per token: step times are easy to read
SIMPLE_COST = StepCost(
    base_s=1.0,
    prefill_token_s=0.001,
    prefill_pair_s=0.0,
    decode_seq_s=0.001,
    decode_context_token_s=0.0,
)


def scheduler(
    *, blocks: int = 64, block_size: int = 4, budget: int = 16, seqs: int = 8, ff: bool = False
) -> Scheduler:
    return Scheduler(
        SIMPLE_COST,
        num_blocks=blocks,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=seqs,
        fast_forward=ff,
    )


def seq(rid: int, prompt: int, output: int, keys: list[int] | None = None, bs: int = 4) -> Seq:
    """A request whose full prompt blocks have keys ``keys`` (default: unique to it)."""
    if keys is None:
        keys = [rid * 1000 + i for i in range(prompt // bs)]
    return Seq(rid=rid, prompt_keys=keys, prompt_tokens=prompt, max_output=output)


@dataclass
class Log:
    """Every step a driver ran: its start time, plan and result."""

    steps: list[tuple[float, StepPlan, StepResult]] = field(default_factory=list)
    now: float = 0.0

    def first_token_s(self, rid: int) -> float:
        return next(
            t + p.duration_s for t, p, r in self.steps if any(s.rid == rid for s in r.first_tokens)
        )

    def finish_s(self, rid: int) -> float:
        return next(
            t + p.duration_s for t, p, r in self.steps if any(s.rid == rid for s in r.finished)
        )


def run(sched: Scheduler, log: Log | None = None, steps: int | None = None) -> Log:
    """Step ``sched`` until it is idle (or for ``steps`` steps)."""
    log = log or Log()
    while sched.has_work and (steps is None or steps > 0):
        plan = sched.plan_step()
        assert plan is not None
        result = sched.finish_step()
        log.steps.append((log.now, plan, result))
        log.now += plan.duration_s
        if steps is not None:
            steps -= 1
    return log


# --- the step: budget, decode before prefill, chunked prefill -----------------------


def test_every_step_respects_the_token_budget_and_max_num_seqs() -> None:
    sched = scheduler(budget=16, seqs=3)
    for rid in range(7):
        sched.add(seq(rid, prompt=10 + 7 * rid, output=5 + rid))
    log = run(sched)
    assert len({s.rid for _, _, r in log.steps for s in r.finished}) == 7
    for _, plan, _ in log.steps:
        assert sum(n for _, n in plan.scheduled) <= 16
        assert len(plan.scheduled) <= 3
    assert max(len(p.scheduled) for _, p, _ in log.steps) == 3  # the cap was reached


def test_running_decodes_are_scheduled_before_a_waiting_prefill_which_gets_the_rest() -> None:
    sched = scheduler(budget=16)
    for rid in range(3):
        sched.add(seq(rid, prompt=4, output=10))
    run(sched, steps=1)  # the three 4-token prompts prefill together and sample
    sched.add(seq(9, prompt=40, output=2))
    plan = sched.plan_step()
    assert plan is not None
    assert [(s.rid, n) for s, n in plan.scheduled] == [(0, 1), (1, 1), (2, 1), (9, 13)]
    assert plan.work == StepWork(
        prefill_tokens=13, prefill_pairs=prefill_pairs(0, 13), decode_seqs=3, decode_context=15
    )
    assert plan.duration_s == pytest.approx(1.0 + 0.001 * 13 + 0.001 * 3)


def test_a_long_prompt_is_prefilled_in_chunks_and_its_first_token_waits_for_the_last() -> None:
    sched = scheduler(budget=16)
    sched.add(seq(0, prompt=40, output=3))
    log = run(sched)
    chunks = [n for _, p, _ in log.steps for s, n in p.scheduled if p.work.prefill_tokens]
    assert chunks == [16, 16, 8]
    # three prefill steps of 1 s + 1 ms per token; the first token ends the third
    assert log.first_token_s(0) == pytest.approx(3 * 1.0 + 40 * 0.001)
    assert log.finish_s(0) == pytest.approx(log.first_token_s(0) + 2 * 1.001)


def test_ttft_through_the_replay_counts_every_chunk_of_a_long_prompt(tmp_path: Path) -> None:
    trace = load_trace(write_mooncake(tmp_path, [(0, [1, 2, 3, 4], 2048, 4)]))
    engine = spec(cost=SIMPLE_COST, max_num_batched_tokens=512)
    out = replay_policy(trace, build_policy("round_robin"), fleet(engine, pods=1))
    assert out.ttft_s == [pytest.approx(4 * 1.0 + 2048 * 0.001)]


# --- KV blocks ----------------------------------------------------------------------


def test_the_pool_evicts_free_blocks_least_recently_freed_first_and_each_chain_tail_first() -> None:
    pool = BlockPool(6)
    a = pool.allocate(3)
    for b, k in zip(a, (11, 12, 13), strict=True):
        pool.cache(b, k)
    b_ = pool.allocate(3)
    for b, k in zip(b_, (21, 22, 23), strict=True):
        pool.cache(b, k)
    pool.free(reversed(a))  # request A finishes first, then B
    pool.free(reversed(b_))
    evicted = []
    for _ in range(6):
        (blk,) = pool.allocate(1)
        evicted.append(blk)
    assert evicted == [a[2], a[1], a[0], b_[2], b_[1], b_[0]]
    assert pool.hit_blocks([11, 12, 13]) == 0 and pool.resident_blocks == 0


def test_a_finished_request_loses_its_tail_blocks_first_so_its_prefix_stays_findable() -> None:
    sched = scheduler(blocks=4)
    sched.add(seq(0, prompt=12, output=1, keys=[1, 2, 3]))
    run(sched)
    assert sched.pool.hit_blocks([1, 2, 3]) == 3
    sched.add(seq(1, prompt=8, output=1))  # 2 blocks: the never-used one and one of 0's
    run(sched)
    assert sched.pool.hit_blocks([1, 2, 3]) == 2


def test_blocks_held_by_a_running_request_are_never_evicted() -> None:
    pool = BlockPool(4)
    held = pool.allocate(2)
    pool.cache(held[0], 1)
    pool.cache(held[1], 2)
    spare = pool.allocate(2)
    pool.free(reversed(spare))
    assert pool.num_free == 2
    pool.allocate(2)
    with pytest.raises(ValueError, match="cannot allocate"):
        pool.allocate(1)
    assert pool.hit_blocks([1, 2]) == 2  # the held chain survived the pressure


def test_a_hit_on_a_free_block_takes_it_out_of_the_eviction_queue() -> None:
    pool = BlockPool(2)
    blocks = pool.allocate(2)
    pool.cache(blocks[0], 7)
    pool.free(reversed(blocks))
    assert pool.num_free == 2 and pool.usage == 0.0
    pool.touch(pool.match([7]))
    assert pool.num_free == 1 and pool.usage == 0.5
    (taken,) = pool.allocate(1)
    assert taken == blocks[1] and pool.hit_blocks([7]) == 1


def test_duplicate_blocks_of_one_key_stay_findable_until_the_last_is_evicted() -> None:
    pool = BlockPool(2)
    first, second = pool.allocate(2)
    pool.cache(first, 5)
    pool.cache(second, 5)  # two requests computed the same block: vLLM keeps both
    assert pool.match([5]) == [first]
    pool.free([first, second])
    pool.allocate(1)  # evicts `first`
    assert pool.match([5]) == [second]
    pool.allocate(1)
    assert pool.match([5]) == []


def test_a_finished_request_leaves_its_prompt_and_all_but_its_last_output_token_cached() -> None:
    sched = scheduler(blocks=16)
    sched.add(seq(0, prompt=8, output=9))  # 8 + 9 - 1 = 16 tokens computed = 4 full blocks
    run(sched)
    pool = sched.pool
    assert pool.resident_blocks == 4
    assert pool.usage == 0.0  # cached but free: counted as free, as vLLM reports it
    assert pool.hit_blocks([0, 1]) == 2  # the prompt's blocks, findable by their keys


def test_the_prefix_cache_is_looked_up_when_a_request_is_scheduled_not_when_it_arrives() -> None:
    sched = scheduler(budget=8)
    keys = [100, 101, 102, 103, 104]
    a, b = seq(0, prompt=22, output=2, keys=keys), seq(1, prompt=22, output=2, keys=keys)
    sched.add(a)
    sched.add(b)  # both arrive at an empty cache
    assert sched.pool.hit_blocks(keys) == 0
    run(sched)
    # b waited behind a's three chunks, then found a's 5 full blocks cached
    assert (a.hit_tokens, b.hit_tokens) == (0, 20)


def test_the_last_prompt_token_is_always_computed_even_when_every_block_is_cached() -> None:
    sched = scheduler()
    keys = [7, 8, 9, 10, 11]
    first, again = seq(0, prompt=20, output=1, keys=keys), seq(1, prompt=20, output=1, keys=keys)
    sched.add(first)
    run(sched)
    sched.add(again)
    log = run(sched)
    # 5 blocks cached, but a hit may cover at most 19 tokens: 4 blocks, the 5th recomputed
    assert again.hit_tokens == 16
    assert log.steps[0][1].work.prefill_tokens == 4


# --- preemption ---------------------------------------------------------------------


def test_a_running_request_is_preempted_when_kv_runs_out_and_completes_later() -> None:
    sched = scheduler(blocks=8, block_size=4, budget=64)
    old, new = seq(0, prompt=8, output=14), seq(1, prompt=8, output=14)
    sched.add(old)
    sched.add(new)  # each ends at 8 + 13 = 21 tokens = 6 blocks: both cannot finish
    log = run(sched)
    assert new.preemptions >= 1 and old.preemptions == 0  # the last admitted goes first
    assert sched.preemptions == new.preemptions
    assert log.finish_s(0) < log.finish_s(1)  # the preempted one recomputes, then finishes
    assert new.num_output == 14 and old.num_output == 14
    preempting = next(p for _, p, _ in log.steps if p.preempted)
    assert preempting.preempted == [new]
    assert not sched.running and not sched.waiting and sched.pool.usage == 0.0


def test_a_preempted_request_goes_back_to_the_waiting_queue_front_and_blocks_admission() -> None:
    sched = scheduler(blocks=8, block_size=4, budget=64, seqs=2)
    a, b, c = seq(0, prompt=8, output=14), seq(1, prompt=8, output=14), seq(2, prompt=4, output=1)
    for s in (a, b, c):
        sched.add(s)  # c waits for a seat (max_num_seqs 2)
    log = Log()
    while not b.preemptions:
        run(sched, log, steps=1)
    assert list(sched.waiting) == [b, c]
    # the step that preempts admits no one, although b's seat is free
    preempting = log.steps[-1][1]
    assert preempting.preempted == [b] and [s for s, _ in preempting.scheduled] == [a]


# --- stepping over decode runs ------------------------------------------------------


def test_a_decode_run_is_one_plan_of_many_steps_that_stops_at_the_first_finish() -> None:
    sched = scheduler(ff=True)
    short, long = seq(0, prompt=4, output=5), seq(1, prompt=4, output=9)
    sched.add(short)
    sched.add(long)
    run(sched, steps=1)  # prefill: both sample their first token
    plan = sched.plan_step()
    assert plan is not None and plan.steps == 4  # short has 4 tokens left
    # 4 steps of 2 decodes: 1 s + 2 ms each
    assert plan.duration_s == pytest.approx(4 * 1.002)
    assert [s.rid for s in sched.finish_step().finished] == [0]


def test_a_decode_run_ends_before_the_horizon_it_is_given() -> None:
    sched = scheduler(ff=True)
    sched.add(seq(0, prompt=4, output=50))
    run(sched, steps=1)
    plan = sched.plan_step(max_span_s=3.5)
    assert plan is not None and plan.steps == 3 and plan.duration_s <= 3.5


def test_decode_run_time_equals_the_sum_of_its_steps() -> None:
    cost = PRESETS["llama3-8b-h100"].cost
    one_by_one = sum(
        cost.seconds(StepWork(decode_seqs=7, decode_context=1000 + 7 * j)) for j in range(50)
    )
    assert cost.decode_run_s(7, 1000, 50) == pytest.approx(one_by_one)
    assert cost.decode_steps_within(7, 1000, one_by_one, 80) == 50


def test_stepping_over_decode_runs_gives_the_results_of_stepping_one_by_one(
    tmp_path: Path,
) -> None:
    trace = load_trace(write_mooncake(tmp_path, busy_rows()))
    engine = spec(cost=PRESETS["llama3-8b-h100"].cost, max_num_batched_tokens=2048)
    slow = replay_policy(trace, build_policy("cost"), fleet(engine, fast_forward=False))
    fast = replay_policy(trace, build_policy("cost"), fleet(engine, fast_forward=True))
    assert slow.preemptions > 0  # the comparison covers preemption too
    assert fast.engine_steps == slow.engine_steps
    assert fast.pod_of == slow.pod_of and fast.hit_tokens == slow.hit_tokens
    assert fast.ttft_s == pytest.approx(slow.ttft_s, rel=1e-9)
    assert fast.last_finish_s == pytest.approx(slow.last_finish_s, rel=1e-9)
    assert fast.preemptions == slow.preemptions
    assert fast.pod_preemptions == slow.pod_preemptions


def test_a_replay_counts_each_pods_preemptions(tmp_path: Path) -> None:
    trace = load_trace(write_mooncake(tmp_path, busy_rows()))
    engine = spec(cost=PRESETS["llama3-8b-h100"].cost, max_num_batched_tokens=2048)
    cfg = fleet(engine)
    run = replay_policy(trace, build_policy("cost"), cfg)
    assert len(run.pod_preemptions) == cfg.pods
    assert sum(run.pod_preemptions) == run.preemptions > 0


# --- the replay ---------------------------------------------------------------------


def write_mooncake(tmp_path: Path, rows: Sequence[tuple[float, list[int], int, int]]) -> Path:
    """Rows of (timestamp ms, hash ids, input tokens, output tokens)."""
    path = tmp_path / "trace.jsonl"
    path.write_text(
        "".join(
            json.dumps({"timestamp": ts, "input_length": n, "output_length": out, "hash_ids": ids})
            + "\n"
            for ts, ids, n, out in rows
        )
    )
    return path


def busy_rows(n_conv: int = 12, turns: int = 4) -> list[tuple[float, list[int], int, int]]:
    """Multi-turn chats sharing a system block, fast enough to fill small KV caches."""
    rows = []
    convs = [[0] for _ in range(n_conv)]
    next_id = 1000
    for t in range(turns):
        for c in range(n_conv):
            convs[c] = [*convs[c], next_id, next_id + 1]
            next_id += 2
            ids = list(convs[c])
            rows.append((t * 3000.0 + c * 40.0, ids, 512 * len(ids) - 100, 300 + 40 * c))
    return rows


def spec(**kw: object) -> EngineSpec:
    base = {
        "name": "test",
        "cost": SIMPLE_COST,
        "max_num_batched_tokens": 8192,
        "max_num_seqs": 64,
        "max_model_len": 131072,
        "kv_capacity_tokens": 512 * 64,
    }
    base.update(kw)
    return EngineSpec(**base)  # type: ignore[arg-type]


def fleet(engine: EngineSpec, **kw: object) -> VllmFleetConfig:
    base: dict = {"pods": 3, "capacity_tokens": 512 * 24, "block_size": 512, "engine": engine}
    base.update(kw)
    return VllmFleetConfig(**base)


def test_every_registered_policy_replays_on_vllm_pods(tmp_path: Path) -> None:
    trace = load_trace(write_mooncake(tmp_path, busy_rows()))
    cfg = fleet(PRESETS["llama3-8b-h100"], capacity_tokens=512 * 40)
    n = len(trace.requests)
    for name in available_policies():
        out = summarize(replay_policy(trace, build_policy(name, fleet_defaults(name, cfg)), cfg))
        assert sum(out["requests_per_pod"]) == n, name
        assert out["rejected"] == 0 and 0 < out["ttft_p50_s"] <= out["ttft_p99_s"], name
        assert 0 <= out["hit_rate"] < 1 and out["engine_steps"] > 0, name


def test_the_replay_runs_cost_as_kvroute_serve_ships_it_on_vllm_pods() -> None:
    """Only the prefill rate is handed over, as the prior an operator may set; the slowdown
    per running request is left unset, so the replay learns it as a live router does."""
    cfg = fleet(PRESETS["llama3-8b-h100"])
    given = fleet_defaults("cost", cfg)
    assert given == {"prefill_rate_tokens_per_s": cfg.engine.prefill_rate_tokens_per_s()}
    shipped = CostParams().model_dump()
    replayed = build_policy("cost", given).params.model_dump()
    assert replayed["decode_slowdown_per_running"] is None
    assert {k: v for k, v in replayed.items() if k != "prefill_rate_tokens_per_s"} == {
        k: v for k, v in shipped.items() if k != "prefill_rate_tokens_per_s"
    }


def test_the_replay_is_deterministic(tmp_path: Path) -> None:
    trace = load_trace(write_mooncake(tmp_path, busy_rows()))
    cfg = fleet(PRESETS["llama3-8b-h100"])

    def once() -> PolicyRun:
        return replay_policy(trace, build_policy("cost", fleet_defaults("cost", cfg)), cfg)

    a, b = once(), once()
    assert (a.ttft_s, a.hit_tokens, a.pod_of, a.busy_s) == (
        b.ttft_s,
        b.hit_tokens,
        b.pod_of,
        b.busy_s,
    )


def test_views_report_what_a_vllm_pod_exposes(tmp_path: Path) -> None:
    from tests.scoring.test_replay import RecordingPolicy

    # request 0 prefills 3 full blocks in one 2.536 s step, then decodes 1 token a second
    rows = [(0, [1, 2, 3], 1536, 2000), (5000, [1, 2, 3, 4], 2048, 5)]
    trace = load_trace(write_mooncake(tmp_path, rows))
    policy = RecordingPolicy()
    replay_policy(trace, policy, fleet(spec(), pods=1))
    (view,) = policy.views[1]  # the second request's view: the first one decoding
    assert view.running == 1 and view.waiting == 0
    assert view.hits == {"GPU": 3}
    assert view.resident_blocks == 3 and view.capacity_blocks == 24
    assert view.kv_usage == pytest.approx(4 / 24)  # its generated tokens took a 4th block
    assert view.inflight == 1 and view.outstanding_prefill_tokens == 0


def test_a_prompt_as_long_as_max_model_len_is_rejected_and_left_out_of_ttft(
    tmp_path: Path,
) -> None:
    rows = [(0, [1], 400, 3), (10, [2, 3], 1024, 3)]
    trace = load_trace(write_mooncake(tmp_path, rows))
    out = replay_policy(trace, build_policy("round_robin"), fleet(spec(max_model_len=1024), pods=1))
    assert out.rejected == 1 and math.isnan(out.ttft_s[1]) and math.isnan(out.e2e_s[1])
    assert summarize(out)["ttft_p99_s"] == out.ttft_s[0]
    assert summarize(out)["e2e_p99_s"] == out.e2e_s[0]


# --- presets and the CLI ------------------------------------------------------------


def test_presets_carry_their_derived_capacity_and_overrides_are_validated() -> None:
    p8, p70 = PRESETS["llama3-8b-h100"], PRESETS["llama3-70b-h100-tp4"]
    assert 400_000 < p8.kv_capacity_tokens < 500_000  # 128 KiB a token, ~55 GiB of KV
    assert p70.cost.prefill_token_s > 2 * p8.cost.prefill_token_s
    assert not PRESETS["cpu-tiny"].calibrated
    assert resolve_preset("llama3-8b-h100", {"max_num_seqs": 64}).max_num_seqs == 64
    with pytest.raises(PresetError, match="unknown preset"):
        resolve_preset("nope")
    with pytest.raises(PresetError, match="unknown engine parameter 'speed'"):
        resolve_preset("llama3-8b-h100", {"speed": 2})
    with pytest.raises(PresetError, match="base_s"):
        resolve_preset("llama3-8b-h100", {"base_s": -1})
    with pytest.raises(PresetError, match="max_num_seqs"):
        resolve_preset("llama3-8b-h100", {"max_num_seqs": 0})


def test_cli_replays_with_the_vllm_pod_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_mooncake(tmp_path, busy_rows(n_conv=4, turns=2))
    args = [str(path), "--pods", "2", "--pod-model", "vllm", "--preset", "llama3-70b-h100-tp4"]
    assert main([*args, "--policy", "cost", "--json", "--engine-param", "max_num_seqs=32"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fleet"]["pod_model"] == "vllm"
    assert out["fleet"]["engine"]["max_num_seqs"] == 32
    assert out["fleet"]["capacity_tokens"] == PRESETS["llama3-70b-h100-tp4"].kv_capacity_tokens
    assert out["policies"]["cost"]["engine_steps"] > 0
    assert main([*args, "--policy", "round_robin"]) == 0
    assert "pod model vllm, preset llama3-70b-h100-tp4" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--pod-model", "vllm", "--preset", "gpt-9"], "unknown preset 'gpt-9'"),
        (["--pod-model", "vllm", "--engine-param", "max_num_seqs=0"], "max_num_seqs"),
        (["--pod-model", "vllm", "--engine-param", "warp=9"], "unknown engine parameter"),
        (["--pod-model", "vllm", "--engine-param", "nonsense"], "KEY=VALUE"),
        (["--pod-model", "vllm", "--prefill-rate", "9000"], "--prefill-rate applies to"),
        (["--preset", "llama3-8b-h100", "--capacity-tokens", "4096"], "apply to --pod-model vllm"),
        ([], "capacity-tokens is required"),
    ],
)
def test_cli_rejects_invalid_pod_model_settings_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], named: str
) -> None:
    path = write_mooncake(tmp_path, [(0, [1], 512, 3)])
    assert main([str(path), *extra]) == 2
    err = capsys.readouterr().err
    assert named in err and err.count("\n") == 1


def test_the_matrix_runs_a_cell_on_vllm_pods_with_their_own_rates_and_unequal_caches() -> None:
    from scoring.replay import matrix
    from scoring.replay.offered_load import load_rates, offered_load

    cell = matrix.Cell("chat", 4, "unequal", "medium", 0.8)
    trace = matrix.load_workload(
        "chat", 0, limit=200, block_size=16, traces_dir=str(matrix.TRACES_DIR)
    )
    simple = matrix.fleet_for(cell, trace)
    vllm = matrix.pod_fleet(simple, "vllm")
    assert isinstance(vllm, VllmFleetConfig)
    assert [vllm.pod_capacity(i) for i in range(4)] == list(simple.pod_capacity_tokens or ())
    assert load_rates(vllm).prefill_rate == vllm.engine.prefill_rate_tokens_per_s()
    assert offered_load(trace, vllm) != offered_load(trace, simple)  # each model's own rates
    out = matrix.run_cell(cell, 0, policies=["measured", "cost"], limit=200, pod_model="vllm")
    assert out["fleet"]["pod_model"] == "vllm"
    assert set(out["policies"]) == {"measured", "cost"}
    assert all(0.0 <= m["hit_rate"] <= 1.0 for m in out["policies"].values())


@pytest.mark.parametrize("workload", ["chat", "rag"])
def test_a_vllm_cell_at_80_percent_load_keeps_its_engines_busy_about_that_share(
    workload: str,
) -> None:
    """The offered load of the vLLM model counts the engine time decodes take (their
    attention over long contexts, in batches the cache can hold) beside prefill: scaled
    to 80%, the engines' measured busy time stays near that share of the span.  Counting
    prefill alone, the same cells ran at 4.7x (chat) and 9.3x (RAG) their capacity."""
    from scoring.replay import matrix

    cell = matrix.Cell(workload, 4, "equal", "medium", 0.8)
    out = matrix.run_cell(cell, 0, policies=["cost"], limit=300, block_size=16, pod_model="vllm")
    busy = out["policies"]["cost"]["busy_vs_capacity"]
    assert 0.4 < busy < 1.25


def test_a_matrix_cell_records_the_running_requests_its_vllm_pods_preempted() -> None:
    """Small caches at 110% load: running requests outgrow the KV blocks they were
    admitted into, vLLM preempts them (recomputed later), and each policy's row counts
    it, in the JSON and in the cell table's last column."""
    from scoring.replay import matrix
    from scoring.replay.matrix_report import cell_table

    cell = matrix.Cell("chat", 4, "unequal", "small", 1.1)
    out = matrix.run_cell(cell, 0, policies=["cost"], limit=400, block_size=16, pod_model="vllm")
    preempted = out["policies"]["cost"]["preemptions"]
    assert preempted > 0
    assert cell_table([out]).splitlines()[-1].endswith(f"| {preempted:,} |")
