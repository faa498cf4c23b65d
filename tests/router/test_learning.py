"""RouteLearner's rules, on plain data: which pods learn, what a routed request writes,
how the hit-counter probe judges, and what ends learning."""

from __future__ import annotations

from router.config import SpeculativeSettings
from router.decision.learning import PROBE_PATIENCE, RouteLearner
from router.decision.request import Routed
from router.fleet.scrape import Scraped
from scoring.policies.base import Decision, PodView, RouteRequest
from tests.support.clock import ManualClock

BS = 16
KEYS = list(range(100, 110))  # a 10-block chain
PROMPT = 10 * BS + 5


def learner(events_off: bool = False, **kw: object) -> RouteLearner:
    settings = SpeculativeSettings.model_validate(kw)
    return RouteLearner(settings, events_off=events_off, clock=ManualClock())


def routed(pod: str, gpu: int = 0, spec: int = 0, approximate: bool = False) -> Routed:
    route = RouteRequest("r", "m", PROMPT, KEYS, BS)
    views = {pod: PodView(pod, {"GPU": gpu} if gpu else {}, speculative=spec)}
    return Routed(
        "completion",
        {},
        "m",
        False,
        route,
        Decision(pod, {pod: 0.0}),
        [pod],
        views,
        approximate=approximate,
    )


def scrape(hits: float, waiting: int = 0) -> Scraped:
    return Scraped(at=0.0, waiting=waiting, prefix_hits=hits)


def test_which_pods_learn() -> None:
    assert learner(events_off=True).reason("a") == "events_off"
    lr = learner()
    assert lr.reason("a") == "never_published"
    lr.published("a")
    assert lr.reason("a") is None
    lr.cleared("a")
    assert lr.reason("a") == "cleared"
    lr.all_cleared("a")
    assert lr.reason("a") is None


def test_a_routed_request_writes_only_what_the_index_does_not_show() -> None:
    lr = learner()
    lr.on_sent(routed("a", gpu=4), "a")  # never published: learns
    assert len(lr.index) == 6
    assert lr.extend(KEYS, ["a"], {"a": {"GPU": 4}}) == {"a": 10}
    lr.published("b")
    lr.on_sent(routed("b"), "b")  # publishes, routed_ttl_s off: nothing written
    assert not lr.index.holds("b")


def test_approximate_tokenizations_write_nothing() -> None:
    lr = learner(events_off=True)
    lr.on_sent(routed("a", approximate=True), "a")
    assert len(lr.index) == 0


def test_routed_ttl_writes_for_every_pod() -> None:
    lr = learner(routed_ttl_s=2.0)
    lr.published("a")
    lr.on_sent(routed("a"), "a")
    assert lr.index.holds("a")


def opened(lr: RouteLearner, known: int, spec: int) -> None:
    lr.on_scraped("a", scrape(1000.0))  # the baseline
    lr.on_sent(routed("a", gpu=known + spec, spec=spec), "a")
    lr.on_scraped("a", scrape(1000.0))  # closes the probe


def test_a_probe_keeps_entries_when_the_counter_moved_past_the_midpoint() -> None:
    lr = learner(events_off=True)
    opened(lr, known=2, spec=8)
    # expected if cached: 10 blocks (the cap is floor((165 - 1) / 16) = 10); if not: 2;
    # midpoint 6 blocks = 96 tokens
    lr.on_scraped("a", scrape(1000.0 + 96))
    assert lr.probes["kept"] == 1
    assert lr.extend(KEYS, ["a"], {"a": {"GPU": 2}}) == {"a": 10}


def test_a_probe_drops_the_speculative_blocks_the_counter_did_not_show() -> None:
    lr = learner(events_off=True)
    opened(lr, known=2, spec=8)
    lr.on_scraped("a", scrape(1000.0 + 95))
    assert lr.probes["dropped"] == 1
    assert lr.dropped["no_hits"] == 8
    assert lr.extend(KEYS, ["a"], {"a": {"GPU": 2}}) is None


def test_a_probe_waits_while_requests_wait_and_gives_up_after_its_patience() -> None:
    lr = learner(events_off=True)
    opened(lr, known=0, spec=10)
    for _ in range(PROBE_PATIENCE - 1):
        lr.on_scraped("a", scrape(1000.0, waiting=3))
    assert not lr.probes
    lr.on_scraped("a", scrape(1000.0, waiting=3))
    assert lr.probes["abandoned"] == 1
    assert lr.index.holds("a")  # no verdict: the entries stay


def test_a_hit_counter_going_back_is_an_engine_restart_and_drops_the_pod() -> None:
    lr = learner(events_off=True)
    lr.on_sent(routed("a"), "a")
    lr.on_scraped("a", scrape(500.0))
    lr.on_scraped("a", scrape(20.0))
    assert lr.dropped["restart"] == 10
    assert not lr.index.holds("a")


def test_a_shared_index_count_halving_means_the_pod_was_cleared() -> None:
    lr = learner()
    lr.index_entries({"a": 100, "b": 100}, ["a", "b"], lambda p: None, shared=True)
    assert lr.reason("a") is None and lr.reason("b") is None
    lr.index_entries({"a": 60, "b": 50}, ["a", "b"], lambda p: None, shared=True)
    assert lr.reason("a") is None and lr.reason("b") == "cleared"


def test_relearning_ends_when_the_index_counts_the_whole_cache() -> None:
    lr = learner()
    lr.published("a")
    lr.cleared("a", carried=KEYS)
    lr.index_entries({"a": 50}, ["a"], lambda p: 64, shared=False)
    assert lr.reason("a") == "cleared"
    lr.index_entries({"a": 64}, ["a"], lambda p: 64, shared=False)
    assert lr.reason("a") is None
