"""`kvroute index` end to end: a simulated vLLM pod publishes KV events over ZMQ, the
indexer writes them into a real Redis-protocol server, and a reader (as a `kvroute
serve --redis` replica would) finds the prompt's blocks there."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client import generate_latest

from router.config import Settings
from router.indexer.main import Indexer, main
from router.sim.pod import SimPod
from router.sim.settings import SimSettings
from scoring.blocks import BlockHasher
from scoring.index.redis import RedisIndex
from tests.support.aio import wait_until

MODEL = "sim-model"
BS = 16
REPO = Path(__file__).resolve().parents[2]
#: the request deadline of the tests' own reads of the index: what they check is what
#: the indexer wrote, not how fast Redis answers (0.1 s, the default, is missed on a
#: loaded machine)
READ_DEADLINE_S = 10.0
#: how long `kvroute index` may take to stop on SIGTERM, on a loaded machine too
STOP_TIMEOUT_S = 60.0


def reader_of(redis_url: str, namespace: str) -> RedisIndex:
    """The test's own client of the index the indexer writes."""
    return RedisIndex.from_url(redis_url, namespace=namespace, request_deadline_s=READ_DEADLINE_S)


@pytest.fixture
async def sim_pod() -> AsyncIterator[SimPod]:
    pod = SimPod(SimSettings(model=MODEL, pod_name="sim-0", block_size=BS, time_scale=0.0))
    await pod.start()
    try:
        yield pod
    finally:
        await pod.stop()


def write_config(tmp_path: Path, pod: SimPod, namespace: str, **extra: Any) -> Path:
    cfg = {
        "redis_namespace": namespace,
        "discovery": {
            "kind": "static",
            "static": [
                {
                    "name": pod.name,
                    "url": pod.url,
                    "events_endpoint": pod.events_endpoint,
                    "replay_endpoint": pod.replay_endpoint_url,
                    "models": [MODEL],
                }
            ],
        },
        **extra,
    }
    path = tmp_path / "kvroute.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def index_process(redis_url: str, config: Path, *extra: str) -> subprocess.Popen[bytes]:
    """`kvroute index` as its own process (stdout and stderr in one pipe)."""
    return subprocess.Popen(
        [
            *[sys.executable, "-m", "router.cli", "index", "--redis", redis_url],
            *["--config", str(config), "--metrics-port", "0", *extra],
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


async def complete(client: httpx.AsyncClient, pod: SimPod, prompt: str) -> list[int]:
    """Send a completion to the pod; return the prompt's token ids (its /tokenize)."""
    r = await client.post(
        f"{pod.url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1}
    )
    r.raise_for_status()
    t = await client.post(f"{pod.url}/tokenize", json={"model": MODEL, "prompt": prompt})
    t.raise_for_status()
    return list(t.json()["tokens"])


def test_main_without_a_redis_url_exits_2_naming_the_flag(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVROUTE_REDIS_URL", raising=False)
    monkeypatch.delenv("KVROUTE_CONFIG", raising=False)
    assert main([]) == 2
    assert "--redis URL" in capsys.readouterr().err


def test_main_with_a_missing_config_file_exits_2(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["--redis", "redis://127.0.0.1:1", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml" in capsys.readouterr().err


def test_main_exits_2_when_discovery_cannot_run(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    cfg = tmp_path / "k8s.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {"discovery": {"kind": "k8s", "k8s": {"namespace": "x", "label_selector": "a=b"}}}
        )
    )
    assert (
        main(["--redis", "redis://127.0.0.1:1", "--config", str(cfg), "--metrics-port", "0"]) == 2
    )
    assert "KUBERNETES_SERVICE_HOST" in capsys.readouterr().err


async def test_indexer_writes_a_sim_pods_events_into_redis_for_router_replicas(
    sim_pod: SimPod, redis_url: str, redis_namespace: str, tmp_path: Path
) -> None:
    settings = Settings.load(["--config", str(write_config(tmp_path, sim_pod, redis_namespace))])
    indexer = Indexer(settings, redis_url, metrics_port=0)
    reader = reader_of(redis_url, redis_namespace)
    hasher = BlockHasher(BS, MODEL)
    await indexer.start()
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            # the SUB connects asynchronously: send until the indexer has seen a batch
            # (a batch lost in the meantime comes back by the join replay)
            n = 0

            async def warmed_up() -> bool:
                nonlocal n
                n += 1
                await complete(client, sim_pod, f"warm-up request number {n} " * 8)
                await asyncio.sleep(0.05)
                return indexer.subscriber.stats.pod("sim-0").batches > 0

            await wait_until(warmed_up)
            prompt = "The quick brown fox jumps over the lazy dog. " * 12
            tokens = await complete(client, sim_pod, prompt)
            keys = hasher.keys(tokens)
            assert len(keys) >= 4

            async def indexed() -> bool:
                hits = await reader.lookup(keys)
                return hits.get("sim-0", {}).get("GPU", 0) == len(keys)

            await wait_until(indexed)

            # the indexer's own endpoints
            m = await client.get(f"{indexer.metrics_url}/metrics")
            assert m.status_code == 200
            assert 'kvroute_event_batches_total{pod="sim-0"}' in m.text
            assert 'component="index"' in m.text and "kvroute_build_info{" in m.text
            h = await client.get(f"{indexer.metrics_url}/health")
            assert h.json()["pods"] == ["sim-0"]
            assert h.json()["events"] > 0

            # a reset of the pod's cache (AllBlocksCleared) empties its entries in Redis
            sim_pod.reset_prefix_cache()

            async def cleared() -> bool:
                return "sim-0" not in await reader.lookup(keys)

            await wait_until(cleared)
        st = indexer.subscriber.stats.pod("sim-0")
        assert st.decode_errors == 0
        assert st.total_resyncs == 0
    finally:
        await indexer.stop()
        await reader.close()


async def test_the_kvroute_index_command_runs_and_stops_on_sigterm(
    sim_pod: SimPod, redis_url: str, redis_namespace: str, tmp_path: Path
) -> None:
    config = write_config(tmp_path, sim_pod, redis_namespace)
    proc = index_process(redis_url, config)
    reader = reader_of(redis_url, redis_namespace)
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            n = 0

            async def indexed() -> bool:
                nonlocal n
                n += 1
                assert proc.poll() is None, proc.stdout.read().decode()  # type: ignore[union-attr]
                tokens = await complete(client, sim_pod, f"request {n} " * 20)
                await asyncio.sleep(0.1)
                return "sim-0" in await reader.lookup(BlockHasher(BS, MODEL).keys(tokens))

            await wait_until(indexed, timeout=60)
    finally:
        await reader.close()
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
    assert rc == 0


def test_main_rejects_a_negative_sweep_interval_naming_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--redis", "redis://127.0.0.1:1", "--sweep-interval", "-1"]) == 2
    assert "--sweep-interval must be >= 0" in capsys.readouterr().err


async def test_the_indexer_sweeps_cleared_pods_ids_out_of_the_index_in_the_background(
    redis_url: str, redis_namespace: str, tmp_path: Path
) -> None:
    config = tmp_path / "kvroute.yaml"
    config.write_text(yaml.safe_dump({"redis_namespace": redis_namespace}))
    settings = Settings.load(["--config", str(config)])
    indexer = Indexer(settings, redis_url, metrics_port=0, sweep_interval_s=0.05)
    # what a cleared pod leaves behind: its retired id in the hints of blocks 1 and 2
    await indexer.index.add("gone", [1, 2])
    await indexer.index.add("live", [1])
    await indexer.index.clear_pod("gone")
    assert await indexer.index.block_keys() == 2
    await indexer.start()
    try:
        await wait_until(lambda: indexer.index.swept == 2)
        assert await indexer.index.block_keys() == 1  # block 2 was held by "gone" only
        assert await indexer.index.lookup([1, 2]) == {"live": {"GPU": 1, "CPU": 1, "DISK": 1}}
        async with httpx.AsyncClient(timeout=10) as client:
            health = (await client.get(f"{indexer.metrics_url}/health")).json()
        assert (health["swept"], health["sweep_errors"]) == (2, 0)
    finally:
        await indexer.stop()


async def test_a_second_indexer_on_the_namespace_waits_as_a_standby_and_takes_over(
    sim_pod: SimPod, redis_url: str, redis_namespace: str, tmp_path: Path
) -> None:
    settings = Settings.load(["--config", str(write_config(tmp_path, sim_pod, redis_namespace))])
    first = Indexer(settings, redis_url, metrics_port=0, lease_s=1.5)
    second = Indexer(settings, redis_url, metrics_port=0, lease_s=1.5)
    reader = reader_of(redis_url, redis_namespace)
    hasher = BlockHasher(BS, MODEL)
    n = 0

    async def indexed_by(indexer: Indexer, client: httpx.AsyncClient) -> bool:
        """A new prompt on the pod ends up in Redis, through ``indexer``."""
        nonlocal n
        n += 1
        tokens = await complete(client, sim_pod, f"standby test prompt {n} " * 10)
        await asyncio.sleep(0.05)
        seen = indexer.subscriber.stats.pod("sim-0").batches > 0
        return seen and "sim-0" in await reader.lookup(hasher.keys(tokens))

    await first.start()
    try:
        await wait_until(lambda: first.active, "the first indexer takes the lease")
        await second.start()
        try:
            async with httpx.AsyncClient(timeout=10) as client:
                await wait_until(lambda: indexed_by(first, client), "the writer indexes")
                health = (await client.get(f"{second.metrics_url}/health")).json()
                assert (health["role"], health["writer"]) == ("standby", first.lease.holder)
                # the standby subscribed to nothing and reports no conflict: one writer
                assert not second.active
                assert second.subscriber.stats.pod("sim-0").batches == 0
                assert second.lease.conflict is None
                text = generate_latest(second.metrics).decode()
                assert "kvroute_index_writer_conflict 0.0" in text
                assert "kvroute_index_writer_active 0.0" in text

                await first.stop()  # gives the lease up: the standby takes over
                await wait_until(lambda: second.active, "the standby takes over")
                await wait_until(lambda: indexed_by(second, client), "the new writer indexes")
                health = (await client.get(f"{second.metrics_url}/health")).json()
                assert (health["role"], health["writer"]) == ("active", second.lease.holder)
                assert "kvroute_index_writer_active 1.0" in generate_latest(second.metrics).decode()
        finally:
            await second.stop()
    finally:
        await first.stop()
        await reader.close()
    # both stopped: the lease was given up, not left to expire
    ix = reader_of(redis_url, redis_namespace)
    try:
        assert await ix.writer() is None
    finally:
        await ix.close()


async def test_an_indexer_whose_lease_was_taken_stops_writing_and_exits_3(
    sim_pod: SimPod, redis_url: str, redis_namespace: str, tmp_path: Path
) -> None:
    config = write_config(tmp_path, sim_pod, redis_namespace)
    proc = index_process(redis_url, config, "--lease-seconds", "1.5")
    ix = reader_of(redis_url, redis_namespace)
    try:

        async def holds() -> bool:
            assert proc.poll() is None, proc.stdout.read().decode()  # type: ignore[union-attr]
            return await ix.writer() is not None

        await wait_until(holds, "the indexer takes the lease", timeout=60)
        # what another process sees after this one stalled past its lease
        holder = await ix.writer()
        assert holder is not None
        await ix.release_writer(holder)
        assert await ix.claim_writer("usurper", 60) is None
        rc = await asyncio.to_thread(proc.wait, 30)
    finally:
        await ix.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    out = proc.stdout.read().decode()  # type: ignore[union-attr]
    assert rc == 3, out
    assert "was taken by usurper" in out
    assert "exiting to restart as a standby" in out


def test_main_rejects_a_lease_that_is_not_positive_naming_the_flag(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--redis", "redis://127.0.0.1:1", "--lease-seconds", "0"]) == 2
    assert "--lease-seconds must be > 0" in capsys.readouterr().err


async def test_redis_losing_its_data_is_noticed_and_every_pod_re_learned(
    sim_pod: SimPod,
    redis_url: str,
    redis_namespace: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import router.indexer.main as indexer_main

    monkeypatch.setattr(indexer_main, "EPOCH_CHECK_S", 0.1)
    settings = Settings.load(["--config", str(write_config(tmp_path, sim_pod, redis_namespace))])
    indexer = Indexer(settings, redis_url, metrics_port=0)
    reader = reader_of(redis_url, redis_namespace)
    hasher = BlockHasher(BS, MODEL)
    await indexer.start()
    try:
        async with httpx.AsyncClient(timeout=10) as client:
            n = 0

            async def warmed_up() -> bool:  # (the SUB connects asynchronously)
                nonlocal n
                n += 1
                await complete(client, sim_pod, f"warm-up request number {n} " * 8)
                await asyncio.sleep(0.05)
                return indexer.subscriber.stats.pod("sim-0").batches > 0

            await wait_until(warmed_up)
            prompt = "Redis forgets everything after a restart without persistence. " * 10
            keys = hasher.keys(await complete(client, sim_pod, prompt))

            async def indexed() -> bool:
                return (await reader.lookup(keys)).get("sim-0", {}).get("GPU", 0) == len(keys)

            await wait_until(indexed, "the prompt's blocks in Redis")
            await wait_until(lambda: indexer._epoch_task is not None, "the epoch watch")
            await asyncio.sleep(0.3)  # the watch has read the epoch at least once
            raw = reader.guard.client
            await raw.flushall()  # the data is gone, epoch included
            assert "sim-0" not in await reader.lookup(keys)

            # no new request: the pod's blocks come back from its replay buffer alone
            async def relearned() -> bool:
                return (await reader.lookup(keys)).get("sim-0", {}).get("GPU", 0) == len(keys)

            await wait_until(relearned, "the pod re-learned after the data loss", timeout=20)
        assert indexer.data_losses._value.get() == 1
        assert indexer.subscriber.stats.pod("sim-0").resyncs["data_loss"] == 1
    finally:
        await indexer.stop()
        await reader.close()
