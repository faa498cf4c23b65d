"""The replay can show policies the scraped metrics as the live router's scrapes do
(``--scrape-interval-s``): as of the last scrape, not exact at each decision."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import pytest

from scoring.policies.base import Decision, PodView, RouteRequest
from scoring.policies.round_robin import RoundRobinPolicy
from scoring.replay.cli import main
from scoring.replay.engine import replay_policy
from scoring.replay.scrapes import Scrapes
from scoring.replay.trace import load_trace
from tests.scoring.test_replay import conversations, fleet, write_jsonl


class Recorder(RoundRobinPolicy):
    """Round robin that records, per decision, the clock and what each pod showed."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[float, dict[str, tuple[object, ...]]]] = []

    def pick(self, request: RouteRequest, pods: Sequence[PodView]) -> Decision:
        shown: dict[str, tuple[object, ...]] = {
            v.pod: (v.waiting, v.running, v.kv_usage, v.inflight, v.outstanding_prefill_tokens)
            for v in pods
        }
        self.seen.append((self.clock(), shown))
        return super().pick(request, pods)


def view(pod: str, waiting: int, inflight: int = 0) -> PodView:
    return PodView(pod=pod, inflight=inflight, waiting=waiting, running=waiting, kv_usage=0.1)


def test_scraped_fields_hold_until_the_next_scrape_and_router_load_stays_exact() -> None:
    s = Scrapes(1.0, start_s=10.0)
    assert s.views(10.2, [view("a", 1, inflight=1)])[0].waiting == 1  # the first scrape
    later = s.views(10.9, [view("a", 5, inflight=4)])[0]
    assert (later.waiting, later.running, later.inflight) == (1, 1, 4)
    fresh = s.views(11.0, [view("a", 7, inflight=4)])[0]  # the scrape at 11 s
    assert (fresh.waiting, fresh.running) == (7, 7)


def test_each_pod_is_scraped_on_its_own_first_decision() -> None:
    s = Scrapes(1.0)
    s.views(0.5, [view("a", 1)])
    shown = s.views(0.6, [view("a", 2), view("b", 3)])
    assert [v.waiting for v in shown] == [1, 3]


def test_an_interval_of_zero_hands_the_views_over_as_they_are() -> None:
    views = [view("a", 1)]
    assert Scrapes(0.0).views(3.0, views) is views


@pytest.mark.parametrize("bad", [-1.0, math.nan])
def test_a_negative_or_nan_interval_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match="scrape interval"):
        Scrapes(bad)


def _replay_recording(tmp_path: Path, interval_s: float) -> Recorder:
    trace = load_trace(write_jsonl(tmp_path / "t.jsonl", conversations(n_conv=20, turns=3)))
    policy = Recorder()
    replay_policy(trace, policy, fleet(pods=2), scrape_interval_s=interval_s)
    return policy


def test_a_replay_with_a_scrape_interval_changes_scraped_fields_only_at_scrape_instants(
    tmp_path: Path,
) -> None:
    exact = _replay_recording(tmp_path, 0.0)
    scraped = _replay_recording(tmp_path, 1.0)
    start = scraped.seen[0][0]

    def changes_within_a_second(p: Recorder, field: int) -> int:
        n = 0
        last: dict[str, tuple[int, object]] = {}
        for now, shown in p.seen:
            window = int((now - start) // 1.0)
            for pod, values in shown.items():
                prev = last.get(pod)
                if prev is not None and prev[0] == window and prev[1] != values[field]:
                    n += 1
                last[pod] = (window, values[field])
        return n

    assert changes_within_a_second(exact, 0) > 0  # the exact replay's queues move in-between
    assert changes_within_a_second(scraped, 0) == 0  # waiting
    assert changes_within_a_second(scraped, 2) == 0  # KV usage
    assert changes_within_a_second(scraped, 3) > 0  # in flight: router-tracked, exact


def test_the_cli_takes_the_interval_reports_it_and_refuses_a_negative_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write_jsonl(tmp_path / "t.jsonl", conversations())
    base = [str(trace), "--pods", "4", "--capacity-tokens", "32768", "--json", "--no-progress"]
    assert main([*base, "--policy", "precise_prefix", "--scrape-interval-s", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["scrape_interval_s"] == 1.0
    assert main([*base, "--scrape-interval-s", "-1"]) == 2
    assert "scrape-interval-s must be >= 0" in capsys.readouterr().err
