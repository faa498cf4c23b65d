"""Trace replay: loaders, the simulated pod model, ceilings, metrics and the CLI."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

from scoring.policies import build_policy
from scoring.policies.base import Decision, PodView, RouteRequest
from scoring.policies.round_robin import RoundRobinPolicy
from scoring.replay.ceilings import infinite_ceiling, pooled_ceiling
from scoring.replay.cli import main
from scoring.replay.engine import replay_policy
from scoring.replay.fleet_args import fleet_defaults
from scoring.replay.report import summarize
from scoring.replay.simpod import FleetConfig, ReplayConfigError
from scoring.replay.trace import load_trace, mooncake_keys
from scoring.replay.workload import workload_stats


def write_jsonl(path: Path, rows: Sequence[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def mooncake_row(ts_ms: float, ids: list[int], out: int = 10, tokens: int | None = None) -> dict:
    return {
        "timestamp": ts_ms,
        "input_length": tokens if tokens is not None else 512 * len(ids),
        "output_length": out,
        "hash_ids": ids,
    }


def conversations(n_conv: int = 13, turns: int = 4, gap_ms: float = 4000.0) -> list[dict]:
    """Multi-turn chats: every turn re-sends the whole conversation plus 2 new blocks."""
    rows = []
    next_id = 1000
    convs: list[list[int]] = [[0] for _ in range(n_conv)]  # block 0: shared system prompt
    for t in range(turns):
        for c in range(n_conv):
            convs[c] = convs[c] + [next_id, next_id + 1]
            next_id += 2
            rows.append(mooncake_row(t * gap_ms + c * 50.0, list(convs[c]), out=20))
    return rows


def fleet(**kw: object) -> FleetConfig:
    base: dict = dict(pods=4, capacity_tokens=512 * 64, block_size=512, prefill_rate=10_000.0)
    base.update(kw)
    return FleetConfig(**base)


# --- loaders ------------------------------------------------------------------------


def test_mooncake_keys_name_whole_prefixes() -> None:
    a = mooncake_keys([1, 2, 3], root=7)
    b = mooncake_keys([1, 2, 4], root=7)
    c = mooncake_keys([9, 2, 3], root=7)
    assert a[:2] == b[:2] and a[2] != b[2]
    assert c[1] != a[1]  # same block id after a different prefix is a different block


def test_malformed_mooncake_lines_are_reported_with_line_numbers_and_skipped(
    tmp_path: Path,
) -> None:
    path = write_jsonl(
        tmp_path / "t.jsonl",
        [
            mooncake_row(0, [1, 2]),
            "{not json",
            {"timestamp": 1, "output_length": 3, "hash_ids": [1]},
            mooncake_row(2, [1, 2], tokens=-5),
            mooncake_row(3, [1, 2, 3], tokens=600),
            "[1, 2]",
            mooncake_row(4, [1, 2, 5]),
        ],
    )
    trace = load_trace(path, "mooncake")
    assert len(trace.requests) == 2
    assert trace.malformed == 5
    lines = dict(trace.errors)
    assert set(lines) == {2, 3, 4, 5, 6}
    assert "input_length" in lines[3] and "input_length" in lines[4]
    assert "hash_ids" in lines[5]


def test_openai_trace_with_builtin_tokenizer_is_exact_and_counts_turns(tmp_path: Path) -> None:
    from router.tokenize import load_tokenizer

    chat = [{"role": "system", "content": "be brief " * 40}, {"role": "user", "content": "hi"}]
    path = write_jsonl(
        tmp_path / "o.jsonl",
        [
            {"timestamp": 0, "body": {"model": "m", "messages": chat, "max_tokens": 7}},
            {"timestamp": 500, "session_id": "s1", "body": {"model": "m", "prompt": "x" * 100}},
            {"body": {"model": "m"}},
        ],
    )
    trace = load_trace(path, "openai", block_size=16, tokenizer=load_tokenizer("builtin"))
    assert not trace.approximate
    assert trace.malformed == 1 and trace.errors[0][0] == 3
    first, second = trace.requests
    assert first.prompt_tokens == len(load_tokenizer("builtin").encode_chat(chat))
    assert len(first.route.block_keys) == first.prompt_tokens // 16
    assert first.output_tokens == 7 and first.turns == 1
    assert second.route.session == "s1" and second.arrival_s == pytest.approx(0.5)


def test_openai_trace_without_tokenizer_is_flagged_as_a_character_estimate(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "o.jsonl", [{"prompt": "a" * 400}])
    trace = load_trace(path, "openai", block_size=16)
    assert trace.approximate
    assert trace.requests[0].prompt_tokens == 100
    assert len(trace.requests[0].route.block_keys) == 400 // 64


# --- the simulated pod model --------------------------------------------------------


def test_an_idle_pod_answers_after_prefilling_the_uncached_prompt(tmp_path: Path) -> None:
    trace = load_trace(write_jsonl(tmp_path / "t.jsonl", [mooncake_row(0, [1, 2, 3, 4])]))
    run = replay_policy(
        trace,
        build_policy("round_robin"),
        fleet(pods=1, prefill_rate=1024.0, decode_interference=0.0),
    )
    assert run.ttft_s == [pytest.approx(2048 / 1024.0)]


def test_requests_queue_fcfs_on_one_pod(tmp_path: Path) -> None:
    rows = [mooncake_row(0, [1, 2]), mooncake_row(0, [3, 4]), mooncake_row(0, [5, 6])]
    trace = load_trace(write_jsonl(tmp_path / "t.jsonl", rows))
    run = replay_policy(
        trace,
        build_policy("round_robin"),
        fleet(pods=1, prefill_rate=1024.0, decode_interference=0.0),
    )
    assert run.ttft_s == [pytest.approx(1.0), pytest.approx(2.0), pytest.approx(3.0)]


def test_a_partial_last_block_counts_only_its_own_tokens(tmp_path: Path) -> None:
    rows = [mooncake_row(0, [1, 2], tokens=700), mooncake_row(10_000, [1, 2], tokens=700)]
    trace = load_trace(write_jsonl(tmp_path / "t.jsonl", rows))
    run = replay_policy(trace, build_policy("round_robin"), fleet(pods=1))
    assert run.hit_tokens == [0, 700]
    assert summarize(run)["hit_rate"] == pytest.approx(0.5)


def test_blocks_evicted_to_the_cpu_tier_still_hit_and_cost_a_transfer(tmp_path: Path) -> None:
    rows = [
        mooncake_row(0, [1, 2]),
        mooncake_row(10_000, [3, 4]),  # evicts blocks 1, 2 from a 2-block GPU cache
        mooncake_row(20_000, [1, 2]),
    ]
    trace = load_trace(write_jsonl(tmp_path / "t.jsonl", rows))
    cfg = fleet(
        pods=1,
        capacity_tokens=1024,
        prefill_rate=1024.0,
        cpu_capacity_tokens=4096,
        cpu_load_rate=10_240.0,
    )
    run = replay_policy(trace, build_policy("round_robin"), cfg)
    assert run.hit_tokens == [0, 0, 1024]
    assert run.gpu_hit_tokens[2] == 0
    # one token is always computed; 1024 tokens come back from CPU at 10,240 tok/s
    assert run.ttft_s[2] == pytest.approx(1 / 1024.0 + 1024 / 10_240.0)


def test_each_pod_holds_its_own_cache_size_when_the_fleet_lists_them(tmp_path: Path) -> None:
    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    rows = [mooncake_row(0, a), mooncake_row(10, b), mooncake_row(20, a), mooncake_row(30, b)]
    trace = load_trace(write_jsonl(tmp_path / "t.jsonl", rows))
    cfg = fleet(pods=2, pod_capacity_tokens=(512 * 8, 512 * 2))
    assert cfg.total_capacity_tokens == 512 * 10
    run = replay_policy(trace, build_policy("round_robin"), cfg)
    # pod-1 keeps only the first two blocks of b (a chain's tail is evicted first)
    assert run.pod_of == [0, 1, 0, 1]
    assert run.hit_tokens == [0, 0, 2048, 1024]


def test_invalid_fleet_settings_are_rejected_naming_them() -> None:
    with pytest.raises(ReplayConfigError, match="pods"):
        fleet(pods=0).validate()
    with pytest.raises(ReplayConfigError, match="capacity-tokens"):
        fleet(capacity_tokens=100).validate()
    with pytest.raises(ReplayConfigError, match="prefill-rate"):
        fleet(prefill_rate=float("nan")).validate()
    with pytest.raises(ReplayConfigError, match="pod-capacity-tokens must list 4 pods"):
        fleet(pod_capacity_tokens=(512, 512)).validate()
    with pytest.raises(ReplayConfigError, match="pod-capacity-tokens must hold"):
        fleet(pod_capacity_tokens=(512, 512, 512, 100)).validate()


class RecordingPolicy(RoundRobinPolicy):
    """Round robin that records the calls the replay makes (a real policy, not a mock)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str, str]] = []
        self.views: list[list[PodView]] = []

    def pick(self, request: RouteRequest, pods: list[PodView]) -> Decision:  # type: ignore[override]
        self.views.append(pods)
        return super().pick(request, pods)

    def on_routed(self, request: RouteRequest, pod: str) -> None:
        self.calls.append(("routed", request.request_id, pod))

    def on_complete(self, request: RouteRequest, pod: str) -> None:
        self.calls.append(("complete", request.request_id, pod))


def test_replay_calls_the_policy_as_the_router_does(tmp_path: Path) -> None:
    trace = load_trace(write_jsonl(tmp_path / "t.jsonl", conversations(n_conv=3, turns=2)))
    policy = RecordingPolicy()
    replay_policy(trace, policy, fleet(pods=2))
    routed = [c for c in policy.calls if c[0] == "routed"]
    completed = [c for c in policy.calls if c[0] == "complete"]
    assert len(routed) == len(completed) == 6
    assert sorted(c[1:] for c in routed) == sorted(c[1:] for c in completed)
    # the second turn of conversation 0 sees its first turn in the cache of the pod it ran on
    second_turn_views = policy.views[3]
    assert any(v.hits.get("GPU", 0) == 3 for v in second_turn_views)


# --- ceilings, comparisons, workload ------------------------------------------------


def test_ceilings_on_a_known_trace(tmp_path: Path) -> None:
    rows = [mooncake_row(0, [1, 2]), mooncake_row(1, [1, 2, 3]), mooncake_row(2, [4])]
    trace = load_trace(write_jsonl(tmp_path / "t.jsonl", rows))
    # reusable: 2 blocks of request 2 -> 1024 of 512*(2+3+1) tokens
    assert infinite_ceiling(trace) == pytest.approx(1024 / 3072)
    assert pooled_ceiling(trace, 512 * 100) == pytest.approx(1024 / 3072)
    assert pooled_ceiling(trace, 512) < infinite_ceiling(trace)


def test_cache_aware_policies_beat_round_robin_on_multi_turn_chats(tmp_path: Path) -> None:
    trace = load_trace(write_jsonl(tmp_path / "t.jsonl", conversations()))
    cfg = fleet(capacity_tokens=512 * 40)
    pooled = pooled_ceiling(trace, cfg.pods * cfg.capacity_tokens)
    hit = {
        name: summarize(replay_policy(trace, build_policy(name, fleet_defaults(name, cfg)), cfg))[
            "hit_rate"
        ]
        for name in ("round_robin", "approx_prefix", "precise_prefix", "cost")
    }
    assert hit["cost"] >= 0.95 * pooled
    assert hit["precise_prefix"] > 2 * hit["round_robin"]
    assert hit["cost"] > 2 * hit["round_robin"]


def test_workload_stats_report_prefix_sharing_and_breakers(tmp_path: Path) -> None:
    rows = [mooncake_row(0, [1, 2]), mooncake_row(1, [1, 3]), mooncake_row(2, [7, 8])]
    stats = workload_stats(load_trace(write_jsonl(tmp_path / "t.jsonl", rows)))
    assert stats["requests"] == 3
    assert stats["prefix_share_rate"] == pytest.approx(1 / 3)  # request 2 reuses block 1
    assert stats["prefix_breakers"] == pytest.approx(1 / 3)  # request 3's first block is unique
    assert stats["prompt_tokens"]["max"] == 1024
    assert stats["turns_per_conversation"] is None


# --- CLI ----------------------------------------------------------------------------


def test_cli_json_is_one_object_with_ceilings_and_every_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", conversations(n_conv=4, turns=2))
    assert main([str(path), "--pods", "2", "--capacity-tokens", "20480", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["ceilings"]) == {"infinite", "pooled"}
    assert set(out["policies"]) == {
        "round_robin",
        "least_load",
        "session",
        "approx_prefix",
        "precise_prefix",
        "cost",
        "dynamo",
        "llmd",
        "measured",
    }
    for metrics in out["policies"].values():
        for key in (
            "hit_rate",
            "ttft_p50_s",
            "ttft_p90_s",
            "ttft_p99_s",
            "throughput_rps",
            "imbalance",
        ):
            assert isinstance(metrics[key], float)
    assert out["params"]["cost"]["prefill_rate_tokens_per_s"] == 8000.0


def test_cli_prints_a_table_and_writes_a_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", conversations(n_conv=4, turns=2))
    png = tmp_path / "out.png"
    rc = main(
        [
            str(path),
            "--capacity-tokens",
            "20480",
            "--policy",
            "cost",
            "--policy",
            "round_robin",
            "--plot",
            str(png),
        ]
    )
    assert rc == 0
    table = capsys.readouterr().out
    assert "pooled cache" in table and "cost" in table and "round_robin" in table
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--pods", "0"], "pods"),
        (["--param", "cost.miss_weight=-1"], "miss_weight"),
        (["--param", "cost.no_such_knob=1"], "no_such_knob"),
        (["--param", "nonsense"], "POLICY.KEY=VALUE"),
        (["--block-size", "16"], "block-size"),
    ],
)
def test_cli_rejects_invalid_parameters_naming_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], named: str
) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", [mooncake_row(0, [1])])
    assert main([str(path), "--capacity-tokens", "4096", *extra]) == 2
    assert named in capsys.readouterr().err


def test_cli_reports_malformed_lines_and_still_replays(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_jsonl(
        tmp_path / "t.jsonl", [mooncake_row(0, [1]), "garbage", mooncake_row(5, [1])]
    )
    assert main([str(path), "--capacity-tokens", "4096", "--policy", "cost", "--json"]) == 0
    captured = capsys.readouterr()
    assert f"{path}:2: skipped" in captured.err
    assert json.loads(captured.out)["trace"]["malformed"] == 1


def test_cli_with_no_valid_request_fails_clearly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_jsonl(tmp_path / "t.jsonl", ["garbage"])
    assert main([str(path), "--capacity-tokens", "4096"]) == 1
    assert "no valid requests" in capsys.readouterr().err


def chat_trace(path: Path, n_conv: int = 21, turns: int = 5) -> Path:
    """Multi-turn chats that all start with one long system prompt (OpenAI bodies)."""
    system = {"role": "system", "content": "You are a helpful assistant. " * 30}
    convs: list[list[dict]] = [[system] for _ in range(n_conv)]
    rows: list[object] = []
    t = 0.0
    for turn in range(turns):
        for c in range(n_conv):
            convs[c] = [
                *convs[c],
                {"role": "user", "content": f"conv {c} turn {turn}: " + "tell me more. " * 40},
            ]
            t += 500.0
            rows.append(
                {
                    "timestamp": t,
                    "session_id": f"c{c}",
                    "body": {"messages": convs[c], "max_tokens": 64},
                }
            )
            convs[c] = [*convs[c], {"role": "assistant", "content": f"answer {turn} " * 30}]
    return write_jsonl(path, rows)


def test_cost_spreads_chats_sharing_a_system_prompt_over_a_small_fleet(tmp_path: Path) -> None:
    from router.tokenize import load_tokenizer

    trace = load_trace(
        chat_trace(tmp_path / "chats.jsonl"),
        "openai",
        block_size=16,
        tokenizer=load_tokenizer("builtin"),
    )
    cfg = FleetConfig(pods=4, capacity_tokens=20_000, block_size=16, prefill_rate=2000.0)
    pooled = pooled_ceiling(trace, 4 * 20_000)

    def run(**params: object) -> dict:
        policy = build_policy("cost", {**fleet_defaults("cost", cfg), **params})
        return summarize(replay_policy(trace, policy, cfg))

    default = run()
    assert default["imbalance"] <= 1.5
    # the prefix-following peers pile the chats onto the pods holding the system prompt
    for peer in ("approx_prefix", "llmd"):
        theirs = summarize(replay_policy(trace, build_policy(peer, fleet_defaults(peer, cfg)), cfg))
        assert theirs["imbalance"] > default["imbalance"]
        assert theirs["hit_rate"] < default["hit_rate"]
        assert theirs["ttft_p90_s"] > default["ttft_p90_s"]
    assert default["hit_rate"] >= 0.7 * pooled
    # the formulas before, without the hot-eviction charge they had not got (on by
    # default since session 21): the miss weight counted in prompts with its fitted pair
    # (backlog_weight 12, share 0.125) keeps more hits on this small fleet, the one both
    # were chosen on (scoring/policies/README.md) ...
    prompt = run(backlog_unit="prompt", fleet_backlog_share=0.125, charge_hot_evictions=False)
    assert prompt["hit_rate"] >= 0.9 * pooled and prompt["imbalance"] <= 1.5
    # ... and pricing every miss there by the fleet's mean backlog lets the hot pod's
    # queue hold traffic, when every hit the index shows counts ...
    fleet = run(
        backlog_unit="prompt",
        fleet_backlog_share=1.0,
        queue_evictions=False,
        lru_evictions=False,
        charge_hot_evictions=False,
    )
    assert fleet["imbalance"] > 2.0
    assert fleet["ttft_p90_s"] > 3 * prompt["ttft_p90_s"]
    # ... less so when only the hits that survive the hot pod's queue count (the default)
    survivors = run(backlog_unit="prompt", fleet_backlog_share=1.0, charge_hot_evictions=False)
    assert survivors["imbalance"] < fleet["imbalance"]
    assert survivors["ttft_p90_s"] < 0.6 * fleet["ttft_p90_s"]


def test_cli_replays_an_openai_trace_with_the_builtin_tokenizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = chat_trace(tmp_path / "chats.jsonl", n_conv=3, turns=3)
    args = [str(path), "--format", "openai", "--tokenizer", "builtin", "--pods", "2"]
    assert main([*args, "--capacity-tokens", "50000", "--policy", "session", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["trace"]["approximate"] is False and out["trace"]["block_size"] == 16
    assert out["workload"]["user_turns_per_request"] == {"mean": 2.0, "p50": 2.0, "max": 3}
    # 3 conversations (session ids) of 3 user turns each
    assert out["workload"]["turns_per_conversation"] == {"mean": 3.0, "p50": 3.0, "max": 3}
    assert out["workload"]["conversations"] == 3
    assert out["policies"]["session"]["hit_rate"] > 0.5  # each chat stays on its pod
