"""Health checks against a real HTTP pod stand-in on loopback (FastAPI + uvicorn)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from fastapi import FastAPI, Response
from prometheus_client import CollectorRegistry, generate_latest
from pydantic import ValidationError

from router.fleet.health import HealthChecker, HealthSettings
from router.fleet.pods import PodRegistry, PodSpec
from tests.support.aio import running, serve_app, wait_until


class FakePod:
    """A pod's /health and /v1/models, switchable by the test."""

    def __init__(self) -> None:
        self.status = 200
        self.hang_s = 0.0
        self.models: list[str] = ["base-model"]
        self.models_status = 200
        app = FastAPI()

        @app.get("/health")
        async def health() -> Response:
            if self.hang_s:
                await asyncio.sleep(self.hang_s)
            return Response(status_code=self.status)

        @app.get("/v1/models")
        async def models() -> Any:
            if self.models_status != 200:
                return Response("boom", status_code=self.models_status)
            return {"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]}

        self.app = app


def free_dead_url() -> str:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return f"http://127.0.0.1:{port}"


def one_pod(url: str, models: tuple[str, ...] = ()) -> PodRegistry:
    reg = PodRegistry()
    reg.set_pods([PodSpec(name="p", url=url, models=models)])
    return reg


def test_settings_reject_unknown_fields_and_bad_values() -> None:
    with pytest.raises(ValidationError, match="intervl_s"):
        HealthSettings.model_validate({"intervl_s": 1})
    with pytest.raises(ValidationError, match="failure_threshold"):
        HealthSettings(failure_threshold=0)


async def test_pod_is_ejected_after_threshold_consecutive_failures_and_readmitted() -> None:
    pod = FakePod()
    async with serve_app(pod.app) as url:
        reg = one_pod(url)
        checker = HealthChecker(reg, HealthSettings(failure_threshold=3))
        state = reg.get("p")
        assert state is not None
        pod.status = 503
        await checker.check_all()
        await checker.check_all()
        assert state.healthy  # 2 failures < threshold 3
        assert state.consecutive_failures == 2
        await checker.check_all()
        assert not state.healthy
        assert checker.ejections["p"] == 1
        assert reg.candidates("base-model") == []
        await checker.check_all()  # still failing: ejected once only
        assert checker.ejections["p"] == 1
        pod.status = 200
        await checker.check_all()
        assert state.healthy
        assert state.consecutive_failures == 0
        assert checker.readmissions["p"] == 1
        assert [p.name for p in reg.candidates("base-model")] == ["p"]
        await checker.aclose()


async def test_a_success_resets_the_consecutive_failure_count() -> None:
    pod = FakePod()
    async with serve_app(pod.app) as url:
        reg = one_pod(url)
        checker = HealthChecker(reg, HealthSettings(failure_threshold=2))
        state = reg.get("p")
        assert state is not None
        for status in (500, 200, 500, 200, 500):
            pod.status = status
            await checker.check_all()
        assert state.healthy
        assert checker.failures["p"] == 3
        await checker.aclose()


async def test_refused_connections_and_timeouts_count_as_failures() -> None:
    reg = one_pod(free_dead_url())
    checker = HealthChecker(reg, HealthSettings(failure_threshold=1, timeout_s=0.2))
    await checker.check_all()
    state = reg.get("p")
    assert state is not None and not state.healthy
    await checker.aclose()

    pod = FakePod()
    pod.hang_s = 2.0
    async with serve_app(pod.app) as url:
        reg = one_pod(url, models=("base-model",))
        settings = HealthSettings(failure_threshold=1, timeout_s=0.1, panic_threshold_pct=0)
        checker = HealthChecker(reg, settings)
        await checker.check_all()
        state = reg.get("p")
        assert state is not None and not state.healthy
        assert state.problem is not None and "Timeout" in state.problem
        await checker.aclose()


@contextlib.asynccontextmanager
async def served(pods: list[FakePod]) -> AsyncIterator[list[str]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [await stack.enter_async_context(serve_app(p.app)) for p in pods]


def fleet(urls: dict[str, str], model: str = "base-model") -> PodRegistry:
    reg = PodRegistry()
    reg.set_pods([PodSpec(name=n, url=u, models=(model,)) for n, u in urls.items()])
    return reg


def healthy(reg: PodRegistry) -> list[str]:
    return sorted(p.name for p in reg.all() if p.healthy)


def panic_gauge(metrics: CollectorRegistry, model: str = "base-model") -> float | None:
    return metrics.get_sample_value("kvroute_health_panic", {"model": model})


async def test_when_every_pod_of_a_model_times_out_none_is_ejected_and_the_model_panics() -> None:
    pods = [FakePod() for _ in range(3)]
    async with served(pods) as (u0, u1, u2):
        reg = fleet({"a": u0, "b": u1, "c": u2})
        metrics = CollectorRegistry()
        settings = HealthSettings(failure_threshold=2, timeout_s=0.1, refresh_models=False)
        checker = HealthChecker(reg, settings, metrics_registry=metrics)
        await checker.check_all()
        assert panic_gauge(metrics) == 0.0
        for p in pods:
            p.hang_s = 1.0
        for _ in range(3):
            await checker.check_all()
        assert healthy(reg) == ["a", "b", "c"]  # routed to all rather than to none
        assert checker.panic == {"base-model"}
        assert panic_gauge(metrics) == 1.0
        assert sum(checker.ejections.values()) == 0
        pods[0].hang_s = 0.0  # a answers again: 1 of 3 < 50%, still a panic
        await checker.check_all()
        assert healthy(reg) == ["a", "b", "c"]
        pods[1].hang_s = 0.0  # 2 of 3 answer: c, still timing out, is ejected
        await checker.check_all()
        assert healthy(reg) == ["a", "b"]
        assert checker.panic == set()
        assert panic_gauge(metrics) == 0.0
        assert checker.ejections["c"] == 1
        await checker.aclose()


async def test_one_pod_timing_out_of_three_is_ejected_as_before() -> None:
    pods = [FakePod() for _ in range(3)]
    async with served(pods) as (u0, u1, u2):
        reg = fleet({"a": u0, "b": u1, "c": u2})
        settings = HealthSettings(failure_threshold=2, timeout_s=0.1, refresh_models=False)
        checker = HealthChecker(reg, settings)
        pods[2].hang_s = 1.0
        for _ in range(2):
            await checker.check_all()
        assert healthy(reg) == ["a", "b"]
        assert checker.panic == set()
        await checker.aclose()


async def test_in_a_panic_a_refusing_or_erroring_pod_is_still_ejected() -> None:
    pods = [FakePod() for _ in range(2)]
    async with serve_app(pods[0].app) as u0, serve_app(pods[1].app) as u1:
        reg = fleet({"refused": free_dead_url(), "erroring": u0, "hung": u1})
        settings = HealthSettings(failure_threshold=1, timeout_s=0.1, refresh_models=False)
        checker = HealthChecker(reg, settings)
        pods[0].status = 500
        pods[1].hang_s = 1.0
        await checker.check_all()
        assert healthy(reg) == ["hung"]  # 0 of 3 answer: a panic keeps only the timeouts
        assert checker.panic == {"base-model"}
        await checker.aclose()


async def test_a_pod_that_timed_out_then_refused_is_not_kept_by_a_panic() -> None:
    pod = FakePod()
    async with serve_app(pod.app) as url:
        reg = fleet({"p": url})
        settings = HealthSettings(failure_threshold=2, timeout_s=0.1, refresh_models=False)
        checker = HealthChecker(reg, settings)
        pod.hang_s = 1.0
        await checker.check_all()
        await checker.check_all()
        assert healthy(reg) == ["p"]  # two timeouts, the only pod: a panic keeps it
        pod.hang_s, pod.status = 0.0, 503
        await checker.check_all()  # an explicit failure: it is down
        assert healthy(reg) == []
        assert checker.panic == set()
        await checker.aclose()


async def test_a_panic_threshold_of_zero_ejects_every_pod_that_times_out() -> None:
    pods = [FakePod() for _ in range(2)]
    async with serve_app(pods[0].app) as u0, serve_app(pods[1].app) as u1:
        reg = fleet({"a": u0, "b": u1})
        settings = HealthSettings(
            failure_threshold=1, timeout_s=0.1, refresh_models=False, panic_threshold_pct=0
        )
        checker = HealthChecker(reg, settings)
        for p in pods:
            p.hang_s = 1.0
        await checker.check_all()
        assert healthy(reg) == []
        await checker.aclose()


async def test_models_are_refreshed_from_v1_models_including_lora_adapters() -> None:
    pod = FakePod()
    pod.models = ["base-model", "sql-lora"]
    async with serve_app(pod.app) as url:
        reg = one_pod(url, models=("declared",))
        checker = HealthChecker(reg, HealthSettings())
        await checker.check_all()
        state = reg.get("p")
        assert state is not None
        assert state.models == {"declared", "base-model", "sql-lora"}
        assert [p.name for p in reg.candidates("sql-lora")] == ["p"]
        pod.models = ["base-model"]  # adapter unloaded
        await checker.check_all()
        assert state.models == {"declared", "base-model"}
        pod.models_status = 500  # a broken /v1/models keeps what we knew
        await checker.check_all()
        assert state.models == {"declared", "base-model"}
        assert state.healthy
        await checker.aclose()


async def test_run_checks_periodically_until_cancelled() -> None:
    pod = FakePod()
    async with serve_app(pod.app) as url:
        reg = one_pod(url)
        checker = HealthChecker(reg, HealthSettings(interval_s=0.01))
        async with running(checker.run()):
            await wait_until(lambda: checker.checks["p"] >= 3, "three periodic checks")


async def test_health_metrics_are_exposed_in_the_given_registry() -> None:
    reg = one_pod(free_dead_url())
    metrics = CollectorRegistry()
    checker = HealthChecker(reg, HealthSettings(failure_threshold=1), metrics_registry=metrics)
    await checker.check_all()
    text = generate_latest(metrics).decode()
    assert 'kvroute_pod_healthy{pod="p"} 0.0' in text
    assert 'kvroute_health_failures_total{pod="p"} 1.0' in text
    assert 'kvroute_health_ejections_total{pod="p"} 1.0' in text
    await checker.aclose()


async def test_a_pod_with_an_unusable_url_fails_its_checks_without_stopping_the_round() -> None:
    pod = FakePod()
    async with serve_app(pod.app) as url:
        reg = PodRegistry()
        reg.set_pods([PodSpec(name="bad", url="http://[::1"), PodSpec(name="good", url=url)])
        checker = HealthChecker(reg, HealthSettings(failure_threshold=1))
        await checker.check_all()
        bad, good = reg.get("bad"), reg.get("good")
        assert bad is not None and not bad.healthy
        assert checker.last_problem["bad"].startswith("InvalidURL")  # not an httpx.HTTPError
        assert good is not None and good.healthy and good.models == {"base-model"}
        await checker.aclose()


async def test_a_v1_models_answer_that_is_not_a_model_list_keeps_the_known_models() -> None:
    pod = FakePod()
    app = pod.app

    @app.get("/v1/models-garbage")
    async def garbage() -> Response:
        return Response("<html>not json</html>", media_type="text/html")

    @app.get("/v1/models-wrong-shape")
    async def wrong_shape() -> Any:
        return {"data": "nope"}

    async with serve_app(app) as url:
        reg = one_pod(url, models=("declared",))
        for path in ("/v1/models-garbage", "/v1/models-wrong-shape"):
            checker = HealthChecker(reg, HealthSettings(models_path=path))
            await checker.check_all()
            state = reg.get("p")
            assert state is not None and state.healthy
            assert state.models == {"declared"}
            await checker.aclose()


async def test_a_configured_model_the_pod_does_not_list_is_warned_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pod = FakePod()  # lists base-model only
    async with serve_app(pod.app) as url:
        reg = one_pod(url, models=("base-modle",))  # a typo in the pod's models:
        checker = HealthChecker(reg, HealthSettings())
        with caplog.at_level("WARNING", logger="router.fleet.health"):
            await checker.check_all()
            await checker.check_all()
        warned = [r.getMessage() for r in caplog.records if "base-modle" in r.getMessage()]
        assert len(warned) == 1 and "lists only base-model" in warned[0]
        assert checker.unserved == {("p", "base-modle")}
        await checker.aclose()


async def test_a_failed_check_leaves_its_problem_on_the_pod_until_a_success() -> None:
    pod = FakePod()
    async with serve_app(pod.app) as url:
        reg = one_pod(url)
        checker = HealthChecker(reg, HealthSettings())
        state = reg.get("p")
        assert state is not None
        pod.status = 503
        await checker.check_all()
        assert state.problem == "HTTP 503"
        pod.status = 200
        await checker.check_all()
        assert state.problem is None
        await checker.aclose()
