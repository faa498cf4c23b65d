"""Clients that ask for a JSON answer, not a stream, in the replay (``json_share``).

Live, vLLM sends a JSON answer whole after its last token, so the router never sees its
first token: the policy hears ``on_finished`` and ``on_complete`` but no
``on_first_token``.  Its prompt stays outstanding prefill in the router's load until a
scrape of the pod's count of first tokens shows it past its first token (the policy
then hears ``on_prefill_done``; scoring/unseen_first_tokens.py), or until the answer
ends.  The replay plays such requests the same way, for both pod models."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import pytest

from scoring.policies import build_policy
from scoring.policies.base import Decision, PodView, RouteRequest
from scoring.policies.round_robin import RoundRobinPolicy
from scoring.replay.cli import main
from scoring.replay.engine import json_answers, replay_policy
from scoring.replay.presets import PRESETS
from scoring.replay.trace import Trace, load_trace
from scoring.replay.vllm_pod import VllmFleetConfig
from tests.scoring.test_replay import fleet as simple_fleet
from tests.scoring.test_replay import mooncake_row, write_jsonl
from tests.scoring.test_vllm_pod import busy_rows, write_mooncake


class Heard(RoundRobinPolicy):
    """Round robin that writes down the hooks it hears and the load each pick saw."""

    def __init__(self) -> None:
        super().__init__()
        self.first_tokens: list[str] = []
        self.prefills_done: list[str] = []
        self.finished: list[str] = []
        self.completed: list[str] = []
        self.outstanding_seen: list[dict[str, int]] = []

    def pick(self, request: RouteRequest, pods: Sequence[PodView]) -> Decision:
        self.outstanding_seen.append({v.pod: v.outstanding_prefill_tokens for v in pods})
        return super().pick(request, pods)

    def on_first_token(self, request: RouteRequest, pod: str, ttft_s: float) -> None:
        self.first_tokens.append(request.request_id)

    def on_prefill_done(self, request: RouteRequest, pod: str) -> None:
        self.prefills_done.append(request.request_id)

    def on_finished(self, request: RouteRequest, pod: str, output_tokens: int | None) -> None:
        self.finished.append(request.request_id)

    def on_complete(self, request: RouteRequest, pod: str) -> None:
        self.completed.append(request.request_id)


def one_pod_fleets() -> list[object]:
    return [
        simple_fleet(pods=1, prefill_rate=1024.0, decode_interference=0.0),
        VllmFleetConfig(
            pods=1, capacity_tokens=512 * 40, block_size=512, engine=PRESETS["llama3-8b-h100"]
        ),
    ]


def two_requests(tmp_path: Path) -> Trace:
    """A long answer, then a second request that arrives after the first one's first
    token and before its end (1024 tokens at 1024 tokens/s, then 400 decode steps)."""
    rows = [mooncake_row(0, [1, 2], out=400), mooncake_row(1500, [3], out=10)]
    return load_trace(write_jsonl(tmp_path / "t.jsonl", rows))


def test_the_share_of_json_answers_is_spread_evenly_over_the_trace() -> None:
    assert json_answers(4, 0.0) == [False] * 4
    assert json_answers(4, 1.0) == [True] * 4
    assert json_answers(6, 0.5) == [False, True] * 3
    assert sum(json_answers(1000, 0.3)) == 300
    assert sum(json_answers(10, 0.3)[:5]) in (1, 2)  # no run of them at one end


@pytest.mark.parametrize("share", [-0.1, 1.5, math.nan])
def test_a_share_outside_zero_to_one_is_refused_by_name(share: float) -> None:
    with pytest.raises(ValueError, match="json_share"):
        json_answers(3, share)


@pytest.mark.parametrize("cfg", one_pod_fleets(), ids=["simple", "vllm"])
def test_a_json_answer_tells_the_policy_its_end_but_no_first_token(
    tmp_path: Path, cfg: object
) -> None:
    trace = load_trace(write_mooncake(tmp_path, busy_rows(n_conv=3, turns=2)))
    ids = [r.route.request_id for r in trace.requests]
    for share, expect_first in ((1.0, []), (0.0, sorted(ids))):
        heard = Heard()
        run = replay_policy(trace, heard, cfg, json_share=share)  # type: ignore[arg-type]
        assert sorted(heard.first_tokens) == expect_first
        assert sorted(heard.finished) == sorted(heard.completed) == sorted(ids)
        assert all(t > 0 for t in run.ttft_s)  # the engine's first token is still timed


@pytest.mark.parametrize("cfg", one_pod_fleets(), ids=["simple", "vllm"])
def test_a_json_answer_s_prompt_stays_outstanding_prefill_until_a_scrape_shows_it_done(
    tmp_path: Path, cfg: object
) -> None:
    trace = two_requests(tmp_path)
    first_prompt = trace.requests[0].prompt_tokens
    seen = {}
    # (streamed or JSON, the pod's first-token count scraped every interval_s)
    for share, interval_s in ((0.0, 0.0), (1.0, 10.0), (1.0, 0.25)):
        heard = Heard()
        run = replay_policy(
            trace,
            heard,
            cfg,  # type: ignore[arg-type]
            json_share=share,
            scrape_interval_s=interval_s,
        )
        assert run.ttft_s[0] < 1.25 and run.last_finish_s > 1.5  # the second: mid-answer
        seen[share, interval_s] = heard.outstanding_seen[1]["pod-0"]
    # no scrape between the first token and the second arrival: held; one: released
    assert seen == {(0.0, 0.0): 0, (1.0, 10.0): first_prompt, (1.0, 0.25): 0}


@pytest.mark.parametrize("cfg", one_pod_fleets(), ids=["simple", "vllm"])
def test_each_json_request_is_released_once_and_a_streamed_one_never(
    tmp_path: Path, cfg: object
) -> None:
    trace = load_trace(write_mooncake(tmp_path, busy_rows(n_conv=3, turns=2)))
    heard = Heard()
    run = replay_policy(trace, heard, cfg, json_share=0.5)  # type: ignore[arg-type]
    json_ids = {
        r.route.request_id for r, j in zip(trace.requests, run.json_answer, strict=True) if j
    }
    assert heard.prefills_done  # a busy pod: most JSON requests end after a scrape
    assert len(set(heard.prefills_done)) == len(heard.prefills_done)
    assert set(heard.prefills_done) <= json_ids
    assert not set(heard.first_tokens) & json_ids


def test_cost_learns_no_prefill_rate_from_json_answers(tmp_path: Path) -> None:
    trace = load_trace(write_mooncake(tmp_path, busy_rows()))
    cfg = VllmFleetConfig(
        pods=2, capacity_tokens=512 * 40, block_size=512, engine=PRESETS["llama3-8b-h100"]
    )
    prior = 3000.0
    rates = {}
    for share in (0.0, 1.0):
        policy = build_policy("cost", {"prefill_rate_tokens_per_s": prior})
        replay_policy(trace, policy, cfg, json_share=share)
        rates[share] = policy.learned()[("prefill_rate_tokens_per_s", "mooncake")]
    assert rates[1.0] == prior
    assert rates[0.0] != prior


def test_cost_learns_the_decode_load_from_the_pods_histograms_when_it_sees_no_first_token(
    tmp_path: Path,
) -> None:
    trace = load_trace(write_mooncake(tmp_path, busy_rows()))
    cfg = VllmFleetConfig(
        pods=2, capacity_tokens=512 * 40, block_size=512, engine=PRESETS["llama3-8b-h100"]
    )
    learned = {}
    for share in (0.0, 1.0):
        policy = build_policy("cost", {})
        replay_policy(trace, policy, cfg, json_share=share)
        learned[share] = policy.learned()
    step, decode = ("step_seconds_per_running", "mooncake"), ("decode_seconds", "mooncake")
    # streamed: from first tokens; JSON: from the scraped inter-token latency and decode
    # time histograms (no first token at all: the fits would keep their priors, 0)
    assert learned[0.0][step] > 0 and learned[1.0][step] > 0
    assert learned[1.0][step] != learned[0.0][step]
    assert learned[1.0][decode] == pytest.approx(learned[0.0][decode], rel=0.2)


def test_once_cost_sees_a_first_token_the_scrapes_no_longer_set_its_decode_load() -> None:
    from scoring.policies.base import PodCounters

    policy = build_policy("cost", {})
    request = RouteRequest(
        request_id="r0", model="m", prompt_tokens=64, block_size=16, block_keys=[1, 2, 3, 4]
    )
    view = PodView(pod="p", hits={}, inflight=0, outstanding_prefill_tokens=0)
    policy.pick(request, [view])
    policy.on_routed(request, "p")

    itl_s = tokens = 0.0

    def scrape(running: int, step_s: float) -> None:  # 100 tokens decoded since the last
        nonlocal itl_s, tokens
        itl_s, tokens = itl_s + 100 * step_s, tokens + 100
        policy.on_scraped("p", PodCounters(running=running, itl_sum_s=itl_s, itl_count=tokens))

    for i in range(40):
        scrape(i % 7, 0.002 + 0.001 * (i % 7))  # steps of 2 ms + 1 ms a running request
    key = ("step_seconds_per_running", "m")
    assert policy.learned()[key] > 0.0005
    policy.on_first_token(request, "p", 0.05)
    before = policy.learned()[key]
    for i in range(40):
        scrape(i % 7, 10.0 * (i % 7))  # 10 s a running request now: not read any more
    assert policy.learned()[key] == before


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan])
def test_a_json_scrape_interval_that_is_not_positive_is_refused_by_name(
    tmp_path: Path, bad: float
) -> None:
    trace = two_requests(tmp_path)
    with pytest.raises(ValueError, match="json_scrape_s"):
        replay_policy(trace, Heard(), one_pod_fleets()[1], json_share=1.0, json_scrape_s=bad)  # type: ignore[arg-type]


def test_the_counts_are_read_at_the_cadence_asked_for_whatever_the_views_scrape(
    tmp_path: Path,
) -> None:
    trace = two_requests(tmp_path)
    cfg = one_pod_fleets()[1]
    seen = {}
    for every_s in (10.0, 0.25):  # views exact either way
        heard = Heard()
        replay_policy(trace, heard, cfg, json_share=1.0, json_scrape_s=every_s)  # type: ignore[arg-type]
        seen[every_s] = heard.outstanding_seen[1]["pod-0"]
    assert seen == {10.0: trace.requests[0].prompt_tokens, 0.25: 0}


def test_the_cli_replays_a_share_of_json_answers_and_reports_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_mooncake(tmp_path, busy_rows(n_conv=4, turns=2))
    args = [str(path), "--pods", "2", "--capacity-tokens", str(512 * 20), "--json"]
    assert main([*args, "--policy", "cost", "--json-share", "0.5"]) == 0
    assert json.loads(capsys.readouterr().out)["json_share"] == 0.5


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (["--json-share", "1.5"], "json-share must be within [0, 1]"),
        (["--json-share", "nan"], "json-share must be within [0, 1]"),
        (["--json-share", "0.5", "--prefill-pods", "1", "--decode-pods", "1"], "P/D mode"),
    ],
)
def test_the_cli_rejects_a_bad_json_share_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], named: str
) -> None:
    path = write_mooncake(tmp_path, [(0, [1], 512, 3)])
    assert main([str(path), "--capacity-tokens", "4096", *extra]) == 2
    err = capsys.readouterr().err
    assert named in err and err.count("\n") == 1


@pytest.mark.parametrize("cfg", one_pod_fleets(), ids=["simple", "vllm"])
def test_each_request_s_end_to_end_time_runs_from_arrival_to_its_last_token(
    tmp_path: Path, cfg: object
) -> None:
    trace = two_requests(tmp_path)
    run = replay_policy(trace, Heard(), cfg)  # type: ignore[arg-type]
    assert all(e > t > 0 for e, t in zip(run.e2e_s, run.ttft_s, strict=True))
    # the last answer to end ends the replay (a vLLM pod's TTFT and end both carry the
    # engine's per-request overhead, outside its steps)
    engine = getattr(cfg, "engine", None)
    overhead = engine.request_overhead_s if engine is not None else 0.0
    ends = [r.arrival_s + e for r, e in zip(trace.requests, run.e2e_s, strict=True)]
    assert max(ends) == pytest.approx(run.last_finish_s + overhead)
    # 400 tokens of answer after the first one's first token, 10 after the second's
    assert run.e2e_s[0] - run.ttft_s[0] > 10 * (run.e2e_s[1] - run.ttft_s[1]) > 0


@pytest.mark.parametrize("cfg", one_pod_fleets(), ids=["simple", "vllm"])
def test_the_summary_gives_the_json_clients_end_to_end_p90_only_when_there_are_some(
    tmp_path: Path, cfg: object
) -> None:
    from scoring.replay.report import summarize

    trace = load_trace(write_mooncake(tmp_path, busy_rows(n_conv=3, turns=2)))
    streamed = summarize(replay_policy(trace, Heard(), cfg))  # type: ignore[arg-type]
    assert streamed["json_e2e_p90_s"] is None
    assert streamed["e2e_p90_s"] > streamed["ttft_p90_s"] > 0
    run = replay_policy(trace, Heard(), cfg, json_share=0.5)  # type: ignore[arg-type]
    half = summarize(run)
    json_e2e = sorted(e for e, j in zip(run.e2e_s, run.json_answer, strict=True) if j)
    assert len(json_e2e) == len(trace.requests) // 2
    assert half["json_e2e_p90_s"] in json_e2e
    assert half["json_e2e_p90_s"] >= json_e2e[len(json_e2e) // 2]
