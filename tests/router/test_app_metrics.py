"""/v1/route (a decision explained without forwarding) and /metrics: requests, tokens,
decisions, the build, what the policy learned, series of departed pods."""

from __future__ import annotations

import importlib.metadata
import math
import platform

from tests.router.app_rig import MODEL, Rig, chat, running, sim

# -- explain + metrics ---------------------------------------------------------------------


async def test_route_explains_without_forwarding(rig: Rig) -> None:
    before = await rig.metrics()
    r = await rig.client.post("/v1/route", json=chat("explain me " * 20))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["pod"] in {"sim-0", "sim-1"}
    assert body["policy"] == "cost"
    assert body["tokenizer"] == "builtin" and body["approximate"] is False
    assert body["prompt_tokens"] > 200 and body["block_size"] == 16
    assert body["blocks"] == body["prompt_tokens"] // 16
    assert body["candidates"][0]["pod"] == body["pod"]
    assert {c["pod"] for c in body["candidates"]} == {"sim-0", "sim-1"}
    for c in body["candidates"]:
        assert {"cached_blocks", "inflight", "outstanding_prefill_tokens", "score"} <= set(c)
    # nothing was forwarded: no request counted
    assert "kvroute_requests_total{" not in before
    assert "kvroute_requests_total{" not in await rig.metrics()


async def test_metrics_count_requests_tokens_and_decisions(rig: Rig) -> None:
    r = await rig.client.post("/v1/chat/completions", json=chat("count me"))
    pod = r.headers["x-kvroute-pod"]
    m = await rig.metrics()
    assert (
        f'kvroute_requests_total{{model="{MODEL}",pod="{pod}",policy="cost",status="200"}} 1.0' in m
    )
    assert f'kvroute_prompt_tokens_total{{model="{MODEL}",pod="{pod}"}}' in m
    assert f'kvroute_predicted_cached_tokens_total{{model="{MODEL}",pod="{pod}"}}' in m
    assert "kvroute_routing_decision_seconds_count 1.0" in m
    assert 'kvroute_tokenization_seconds_count{tokenizer="builtin"} 1.0' in m
    assert f'kvroute_inflight_requests{{pod="{pod}"}} 0.0' in m


async def test_metrics_name_the_build_component_and_policy(rig: Rig) -> None:
    from router.metrics import kvroute_version
    from scoring.compiled import build_kind

    m = await rig.metrics()
    (line,) = [ln for ln in m.splitlines() if ln.startswith("kvroute_build_info{")]
    assert 'component="serve"' in line and 'policy="cost"' in line
    assert f'build="{build_kind()}"' in line  # python in a checkout, unless built in place
    assert f'python="{platform.python_version()}"' in line
    assert f'version="{kvroute_version()}"' in line and line.endswith(" 1.0")
    assert kvroute_version() == importlib.metadata.version("kvroute")


async def test_metrics_show_what_the_policy_learned_from_streamed_first_tokens(rig: Rig) -> None:
    """``cost`` starts a model at its prior rate and learns the model's from first
    tokens; the rejected observations family is there, empty, while nothing was bad."""
    learned = (
        f'kvroute_policy_learned{{model="{MODEL}",policy="cost",'
        'quantity="prefill_rate_tokens_per_s"}'
    )

    def rate(m: str) -> float:
        (line,) = [ln for ln in m.splitlines() if ln.startswith(learned)]
        return float(line.rsplit(" ", 1)[1])

    assert learned not in await rig.metrics()  # no request of the model routed yet
    r = await rig.client.post("/v1/chat/completions", json=chat("first", max_tokens=4))
    assert r.status_code == 200, r.text
    m = await rig.metrics()
    assert rate(m) == 5000.0, [ln for ln in m.splitlines() if "policy_learned" in ln]
    for i in range(3):
        r = await rig.client.post(
            "/v1/chat/completions", json=chat(f"learn {i} " * (20 + 30 * i), stream=True)
        )
        assert r.status_code == 200, r.text
    after = await rig.metrics()
    assert rate(after) != 5000.0 and math.isfinite(rate(after)) and rate(after) > 0
    assert (
        f'kvroute_policy_learned{{model="{MODEL}",policy="cost",quantity="decode_seconds"}}'
        in after
    )
    assert "# TYPE kvroute_policy_rejected_observations_total counter" in after


async def test_metrics_show_each_pod_s_pace_when_the_queue_is_priced_by_it() -> None:
    """With ``cost.queue_slowness`` each pod whose streamed first tokens the policy saw
    has its pace in ``kvroute_policy_pod_learned`` (finite, positive); by default the
    family is empty."""
    series = 'kvroute_policy_pod_learned{pod="sim-0",policy="cost",quantity="queue_slowness"}'
    async with running([sim(0)], policy_params={"queue_slowness": True}) as rig:
        assert "# TYPE kvroute_policy_pod_learned gauge" in await rig.metrics()
        assert series not in await rig.metrics()  # no first token seen yet
        for i in range(3):
            r = await rig.client.post(
                "/v1/chat/completions", json=chat(f"pace {i} " * 30, stream=True)
            )
            assert r.status_code == 200, r.text
        m = await rig.metrics()
        (line,) = [ln for ln in m.splitlines() if ln.startswith(series)]
        pace = float(line.rsplit(" ", 1)[1])
        assert math.isfinite(pace) and pace > 0
    async with running([sim(0)]) as rig:
        r = await rig.client.post("/v1/chat/completions", json=chat("pace", stream=True))
        assert r.status_code == 200, r.text
        m = await rig.metrics()
        assert "# TYPE kvroute_policy_pod_learned gauge" in m
        assert "kvroute_policy_pod_learned{" not in m


def test_a_departed_pod_leaves_no_series_behind() -> None:
    """Every family labelled by pod drops the pod's series when it leaves the fleet; the
    other pods' series stay as they were."""
    from router.metrics import RouterMetrics

    m = RouterMetrics()
    for pod in ("a", "b"):
        pm = m.pod_metrics(MODEL, pod, "cost")
        pm.requests(200).inc()
        pm.requests(502).inc()
        pm.served(100, 64)
        pm.inflight.inc()
        m.child(m.upstream_errors, pod, "connect").inc()
        m.scrape_errors.labels(pod).inc()
        m.index_entries.labels(pod).set(10)
        m.child(m.ttft_seconds, MODEL, pod).observe(0.02)
    m.forget_pod("a")
    text = m.render().decode()
    series = [ln for ln in text.splitlines() if ln and not ln.startswith("#")]
    assert not [ln for ln in series if 'pod="a"' in ln]
    for name in (
        "kvroute_requests_total",
        "kvroute_prompt_tokens_total",
        "kvroute_predicted_cached_tokens_total",
        "kvroute_inflight_requests",
        "kvroute_upstream_errors_total",
        "kvroute_scrape_errors_total",
        "kvroute_index_entries",
        "kvroute_ttft_seconds_bucket",
    ):
        assert [ln for ln in series if ln.startswith(name + "{") and 'pod="b"' in ln], name
    # a pod coming back under the same name counts from zero
    m.pod_metrics(MODEL, "a", "cost").requests(200).inc()
    back = f'kvroute_requests_total{{model="{MODEL}",pod="a",policy="cost",status="200"}} 1.0'
    assert back in m.render().decode()


def test_hot_path_metrics_render_exactly_as_prometheus_client_would() -> None:
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

    from router.metric_families import HotFamily

    ours, theirs = CollectorRegistry(), CollectorRegistry()
    buckets = (0.001, 0.01, 0.1)
    h = HotFamily("histogram", "t_seconds", "doc", ("model",), buckets=buckets)
    c = HotFamily("counter", "t_requests", "doc", ("model", "pod"))
    g = HotFamily("gauge", "t_inflight", "doc", ("pod",))
    for fam in (h, c, g):
        ours.register(fam)
    ph = Histogram("t_seconds", "doc", ["model"], buckets=buckets, registry=theirs)
    pc = Counter("t_requests", "doc", ["model", "pod"], registry=theirs)
    pg = Gauge("t_inflight", "doc", ["pod"], registry=theirs)
    for v in (0.0005, 0.001, 0.001001, 0.01, 0.5, 7.0):  # bounds are inclusive
        h.labels("m").observe(v)
        ph.labels("m").observe(v)
    c.labels("m", "a").inc(3)
    pc.labels("m", "a").inc(3)
    g.labels("a").inc(2)
    g.labels("a").dec()
    pg.labels("a").inc(2)
    pg.labels("a").dec()
    g.labels("gone").inc()
    g.remove("gone")

    def lines(registry: CollectorRegistry) -> list[str]:
        text = generate_latest(registry).decode()
        return sorted(ln for ln in text.splitlines() if "_created" not in ln)

    assert lines(ours) == lines(theirs)
