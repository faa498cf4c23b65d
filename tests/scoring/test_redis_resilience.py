"""The Redis stores when Redis fails: a real valkey-server killed, restarted on the same
port, frozen (SIGSTOP) and thawed, or vanished behind a relay that leaves the client's
connections half-open.

Each test runs its own server (``FaultyServer``); the breakers use short backoffs so
that recovery takes tens of milliseconds, not seconds.  No assertion is about speed:
a bound on how long a call may take (``within``) only tells a call that returned at
its deadline from one that hung until redis-py's 5 s socket timeout.  The calls a test
needs to succeed (filling the pool, the bursts after a recovery) run under a
``patient`` deadline that no slow machine misses (``patient_guard``: a whole test);
the short deadline is kept for the calls that are meant to fail at it.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
import redis.asyncio as aioredis
from redis.backoff import ConstantBackoff
from redis.exceptions import OutOfMemoryError

from router.decision.owners import RedisOwnerStore
from scoring.index.breaker import CircuitBreaker, SharedStateUnavailable
from scoring.index.redis import RedisIndex
from scoring.index.redis_guard import RedisGuard
from scoring.index.redis_load import RedisLoadStore
from tests.support.aio import wait_until
from tests.support.redis_server import FaultyServer
from tests.support.tcp_relay import HalfOpenRelay

T = TypeVar("T")

NS = "resilience"
CHAIN = [11, 12, 13]
#: request deadline of these tests' guards: above the default 0.1 s, so that healthy
#: calls (20 connections opened at once, on 2 cores shared with other jobs) never miss it
DEADLINE_S = 0.3
#: a call that returns within this returned at its deadline, not at a socket timeout
WITHIN_S = 2.0
#: the request deadline of the calls a test needs to succeed: at a load average of 20
#: on 2 cores, 20 connections opened at once missed even the 0.3 s of DEADLINE_S
PATIENT_S = 10.0
#: the registration TTL of the replica that crashes: its heartbeat (every ttl / 3) must
#: not miss it while it lives, on a loaded machine too
CRASH_TTL_S = 3.0


@pytest.fixture
def server(tmp_path: Path) -> Iterator[FaultyServer]:
    with FaultyServer(tmp_path) as s:
        yield s


def fast_breaker(failures_to_open: int = 3) -> CircuitBreaker:
    return CircuitBreaker(failures_to_open=failures_to_open, backoff=ConstantBackoff(0.05))


@pytest.fixture
async def guard(server: FaultyServer) -> AsyncIterator[RedisGuard]:
    # the background deadline is also the sockets' connect and read timeout: patient, so
    # that opening 20 connections at once on a loaded machine never fails
    g = RedisGuard.from_url(
        server.url,
        breaker=fast_breaker(),
        request_deadline_s=DEADLINE_S,
        background_deadline_s=PATIENT_S,
    )
    yield g
    await g.aclose()


@pytest.fixture
async def patient_guard(guard: RedisGuard) -> AsyncIterator[RedisGuard]:
    """The guard with the PATIENT_S request deadline, for tests where no call is meant
    to time out (a killed server refuses at once)."""
    with patient(guard):
        yield guard


@contextlib.contextmanager
def patient(guard: RedisGuard) -> Iterator[None]:
    """Calls on ``guard`` under the PATIENT_S deadline, for lines that test recovery, not
    the deadline (restored afterwards)."""
    short, guard.request_deadline_s = guard.request_deadline_s, PATIENT_S
    try:
        yield
    finally:
        guard.request_deadline_s = short


async def within(coro: Awaitable[T]) -> T:
    return await asyncio.wait_for(coro, WITHIN_S)


async def unavailable(coro: Awaitable[Any]) -> SharedStateUnavailable:
    """The SharedStateUnavailable that ``coro`` raises (within WITHIN_S)."""
    with pytest.raises(SharedStateUnavailable) as err:
        await within(coro)
    return err.value


async def serves(index: RedisIndex) -> bool:
    try:
        await index.lookup(CHAIN)
        return True
    except SharedStateUnavailable:
        return False


# -- deadlines and the breaker ------------------------------------------------------------


async def test_a_hung_server_fails_each_call_at_its_deadline_not_the_socket_timeout(
    server: FaultyServer, guard: RedisGuard
) -> None:
    index = RedisIndex(guard, namespace=NS)
    owners = RedisOwnerStore(guard, NS, 60, owns_client=False)
    load = RedisLoadStore(guard, namespace=NS)
    await index.add("pod-a", CHAIN)
    server.freeze()
    assert (await unavailable(index.lookup(CHAIN))).kind == "timeout"
    assert (await unavailable(owners.get("resp-1"))).kind == "timeout"
    err = await unavailable(load.snapshot(["pod-a"]))
    assert (err.op, err.kind) == ("load_snapshot", "timeout")
    assert f"no answer within {DEADLINE_S:g}s" in str(err)
    assert isinstance(err.__cause__, TimeoutError)
    server.thaw()
    await load.close()


async def test_after_n_failures_calls_fail_at_once_then_a_probe_closes_it_when_redis_is_back(
    server: FaultyServer, guard: RedisGuard
) -> None:
    index = RedisIndex(guard, namespace=NS)
    await index.add("pod-a", CHAIN)
    states: list[str] = []
    errors: list[tuple[str, str]] = []
    guard.breaker.listen(on_state=states.append, on_error=lambda op, k: errors.append((op, k)))
    server.freeze()
    for _ in range(3):
        assert (await unavailable(index.lookup(CHAIN))).kind == "timeout"
    assert guard.breaker.is_open and guard.breaker.degraded == 1
    assert (await unavailable(index.lookup(CHAIN))).kind == "open"  # no network touched
    server.thaw()
    await wait_until(lambda: serves(index), "the probe to close the breaker", timeout=10)
    assert guard.breaker.state == "closed" and guard.breaker.degraded == 0
    assert await index.lookup(CHAIN) == {"pod-a": {"GPU": 3, "CPU": 3, "DISK": 3}}
    assert errors[:4] == [("lookup", "timeout")] * 3 + [("lookup", "open")]
    assert states[0] == "open" and states[-1] == "closed"


async def test_stores_on_one_guard_share_its_breaker(
    server: FaultyServer, patient_guard: RedisGuard
) -> None:
    index = RedisIndex(patient_guard, namespace=NS)
    owners = RedisOwnerStore(patient_guard, NS, 60, owns_client=False)
    server.kill()
    for _ in range(3):
        assert (await unavailable(index.lookup(CHAIN))).kind == "connection"
    assert (await unavailable(owners.put("resp-1", "pod-a"))).kind == "open"
    server.restart()
    await wait_until(lambda: serves(index), "the breaker to close", timeout=10)
    await within(owners.put("resp-1", "pod-a"))
    assert await owners.get("resp-1") == "pod-a"


# -- reconnecting ---------------------------------------------------------------------------


async def fill_pool(index: RedisIndex, n: int) -> None:
    """Open ``n`` pooled connections (n lookups at once), all idle afterwards."""
    with patient(index.guard):
        await asyncio.gather(*(index.lookup(CHAIN) for _ in range(n)))
    pool = index.guard.client.connection_pool
    assert len(pool._available_connections) >= n // 2  # the pool holds them


async def test_a_restarted_server_is_served_again_with_no_error_from_old_connections(
    server: FaultyServer, patient_guard: RedisGuard
) -> None:
    index = RedisIndex(patient_guard, namespace=NS)
    await index.add("pod-a", CHAIN)
    await fill_pool(index, 20)
    server.kill()
    assert (await unavailable(index.lookup(CHAIN))).kind == "connection"
    server.restart()  # a new, empty server on the same port
    await wait_until(lambda: serves(index), "lookups to work again", timeout=10)
    # every old pooled connection is gone: 40 concurrent calls, no failure
    failures_before = sum(patient_guard.breaker.errors.values())
    results = await asyncio.gather(*(index.lookup(CHAIN) for _ in range(40)))
    assert results == [{}] * 40  # the restarted server lost the index
    assert sum(patient_guard.breaker.errors.values()) == failures_before


async def test_connections_left_half_open_by_a_vanished_server_are_dropped(
    server: FaultyServer,
) -> None:
    async with HalfOpenRelay(server.port) as relay:
        breaker = fast_breaker(failures_to_open=3)
        guard = RedisGuard.from_url(
            f"redis://127.0.0.1:{relay.port}/0", breaker=breaker, request_deadline_s=DEADLINE_S
        )
        index = RedisIndex(guard, namespace=NS)
        try:
            with patient(guard):
                await index.add("pod-a", CHAIN)
            await fill_pool(index, 20)
            # the server vanishes and comes back; the relay leaves the 20 pooled
            # connections open and silent, as a dead peer without FIN or RST does
            server.kill()
            server.restart()
            assert (await unavailable(index.lookup(CHAIN))).kind == "timeout"
            # that failure dropped every idle connection: calls at once (each on a
            # connection of its own, as under load) all open new ones; one left on a
            # silent connection would fail, at the patient deadline at the latest
            with patient(guard):
                results = await asyncio.gather(*(index.lookup(CHAIN) for _ in range(20)))
            assert results == [{}] * 20
            assert breaker.errors == {("lookup", "timeout"): 1}
            assert breaker.opened == 0
        finally:
            await guard.aclose()


async def test_connections_to_a_frozen_server_recover_when_it_is_thawed(
    server: FaultyServer, guard: RedisGuard
) -> None:
    index = RedisIndex(guard, namespace=NS)
    with patient(guard):
        await index.add("pod-a", CHAIN)
    await fill_pool(index, 20)
    server.freeze()
    outcomes = await asyncio.gather(
        *(index.lookup(CHAIN) for _ in range(20)), return_exceptions=True
    )
    assert {e.kind for e in outcomes if isinstance(e, SharedStateUnavailable)} <= {
        "timeout",
        "open",
    }
    assert all(isinstance(e, SharedStateUnavailable) for e in outcomes)
    server.thaw()
    await wait_until(lambda: serves(index), "lookups to work again", timeout=10)
    with patient(guard):
        results = await asyncio.gather(*(index.lookup(CHAIN) for _ in range(20)))
    assert results == [{"pod-a": {"GPU": 3, "CPU": 3, "DISK": 3}}] * 20


# -- the indexer's writes ---------------------------------------------------------------------


async def test_a_write_batch_to_a_hung_server_fails_at_the_background_deadline(
    server: FaultyServer,
) -> None:
    guard = RedisGuard.from_url(
        server.url, breaker=fast_breaker(), request_deadline_s=DEADLINE_S, background_deadline_s=0.6
    )
    index = RedisIndex(guard, namespace=NS, batch_keys=2)
    try:
        server.freeze()
        err = await unavailable(index.apply_ops([("add", "pod-a", "GPU", [1, 2, 3, 4, 5])]))
        assert (err.op, err.kind) == ("index_apply", "timeout")
        assert "no answer within 0.6s" in str(err)
    finally:
        server.thaw()
        await guard.aclose()


async def test_write_errors_the_server_answers_are_raised_as_they_are(
    server: FaultyServer, patient_guard: RedisGuard
) -> None:
    index = RedisIndex(patient_guard, namespace=NS)
    raw = aioredis.Redis.from_url(server.url)
    try:
        await raw.config_set("maxmemory", 1)  # every write is refused with OOM
        with pytest.raises(OutOfMemoryError, match="maxmemory"):
            await within(index.add("pod-a", CHAIN))
        assert await index.lookup(CHAIN) == {}  # reads still work
        assert patient_guard.breaker.state == "closed"
        assert patient_guard.breaker.errors == {("index_add", "error"): 1}
    finally:
        await raw.config_set("maxmemory", 0)
        await raw.aclose()


# -- the load view ------------------------------------------------------------------------------


async def test_load_updates_never_raise_while_redis_is_down_and_snapshot_says_so(
    server: FaultyServer, patient_guard: RedisGuard
) -> None:
    load = RedisLoadStore(patient_guard, namespace=NS, replica="a")
    await load.begin("pod-a", 100)
    server.kill()
    await within(load.begin("pod-a", 50))
    await within(load.prefill_done("pod-a", 100))
    await within(load.begin("pod-b", 10))
    await within(load.end("pod-b"))
    await within(load.clear_pod("pod-c"))
    assert load.local_snapshot() == {"pod-a": (2, 50), "pod-b": (0, 10)}
    assert load.local_snapshot(["pod-a", "pod-z"]) == {"pod-a": (2, 50), "pod-z": (0, 0)}
    assert (await unavailable(load.snapshot(["pod-a"]))).kind in ("connection", "open")
    assert load.write_errors >= 1
    server.restart()
    await load.close()


async def test_requests_ended_during_an_outage_leave_no_residue_once_redis_is_back(
    server: FaultyServer, guard: RedisGuard
) -> None:
    a = RedisLoadStore(guard, namespace=NS, replica="a")
    index = RedisIndex(guard, namespace=NS)
    other = RedisGuard.from_url(server.url, breaker=fast_breaker(), request_deadline_s=PATIENT_S)
    b = RedisLoadStore(other, namespace=NS, replica="b")
    try:
        with patient(guard):
            for _ in range(3):
                await a.begin("pod-a", 100)
        await b.begin("pod-a", 7)
        assert await b.snapshot(["pod-a"]) == {"pod-a": (4, 307)}
        server.freeze()  # (the data survives a freeze)
        for _ in range(3):
            await within(a.prefill_done("pod-a", 100))
            await within(a.end("pod-a"))
        assert guard.breaker.is_open
        assert a.local_snapshot() == {}
        server.thaw()
        # no further change on replica a: a lookup on the same guard is the probe, and
        # the breaker closing makes the store republish its table at once
        await wait_until(lambda: serves(index), "the breaker to close", timeout=10)
        await wait_until(
            lambda: _equals(b.snapshot(["pod-a"]), {"pod-a": (1, 7)}), "replica a's residue to go"
        )
        # the residue went because the table was republished whole after the outage (the
        # start's first write may or may not have been a whole-table one: a race, not a rule)
        assert a.republished >= 1
    finally:
        await a.close()
        await b.close()
        await other.aclose()


async def test_after_a_failed_write_the_next_heartbeat_republishes_the_table(
    server: FaultyServer, patient_guard: RedisGuard
) -> None:
    a = RedisLoadStore(patient_guard, namespace=NS, replica="a")
    raw = aioredis.Redis.from_url(server.url)
    try:
        await a.begin("pod-a", 100)
        await raw.config_set("maxmemory", 1)  # writes refused (OOM); reads still work
        await within(a.prefill_done("pod-a", 100))  # their writes fail for sure
        await within(a.end("pod-a"))
        await raw.config_set("maxmemory", 0)
        assert a.write_errors == 2 and patient_guard.breaker.state == "closed"
        assert await a.snapshot() == {"pod-a": (1, 100)}  # the residue, for now
        await a.heartbeat()
        await wait_until(lambda: _equals(a.snapshot(), {}), "the residue to go")
    finally:
        await raw.aclose()
        await a.close()


async def test_counts_lost_by_a_restarted_server_are_republished_whole(
    server: FaultyServer, patient_guard: RedisGuard
) -> None:
    a = RedisLoadStore(patient_guard, namespace=NS, replica="a")
    await a.begin("pod-a", 100)
    await a.begin("pod-b", 20)
    server.kill()
    server.restart()  # empty: replica a's mirror is gone
    await wait_until(lambda: _ok(a.begin("pod-c", 1)), "writes to work again", timeout=10)
    await wait_until(
        lambda: _equals(a.snapshot(), {"pod-a": (1, 100), "pod-b": (1, 20), "pod-c": (1, 1)}),
        "the whole table back in Redis",
    )


async def test_a_mirror_that_expired_is_republished_at_the_next_heartbeat(
    server: FaultyServer, patient_guard: RedisGuard
) -> None:
    a = RedisLoadStore(patient_guard, namespace=NS, replica="a")
    await a.begin("pod-a", 100)
    raw = aioredis.Redis.from_url(server.url)
    try:
        await raw.delete(b"{" + NS.encode() + b"}:load:h:a")  # as if its TTL ran out
        assert await a.snapshot() == {}
        await a.heartbeat()
        await wait_until(lambda: _equals(a.snapshot(), {"pod-a": (1, 100)}), "republished")
    finally:
        await raw.aclose()
        await a.close()


async def test_a_crashed_replicas_counts_vanish_after_ttl(server: FaultyServer) -> None:
    code = (
        "import asyncio, sys\n"
        "from scoring.index.redis_load import RedisLoadStore\n"
        "async def main():\n"
        f"    s = RedisLoadStore.from_url({server.url!r}, namespace={NS!r}, ttl_s={CRASH_TTL_S},"
        f" request_deadline_s={PATIENT_S})\n"
        "    await s.begin('pod-a', 5)\n"
        "    print('begun', flush=True)\n"
        "    await asyncio.sleep(60)\n"
        "asyncio.run(main())\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    survivor = RedisLoadStore.from_url(server.url, namespace=NS, request_deadline_s=PATIENT_S)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"begun"
        # (begin waits for its mirror at most its deadline; the write may land later)
        await wait_until(
            lambda: _equals(survivor.snapshot(["pod-a"]), {"pod-a": (1, 5)}),
            "the other replica's count",
        )
        proc.kill()  # no close: its counts stay until its registration runs out
        proc.wait()
        await wait_until(
            lambda: _equals(survivor.snapshot(["pod-a"]), {"pod-a": (0, 0)}),
            "the crashed replica to drop out",
        )
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        await survivor.close()


async def test_a_restarted_replica_replaces_the_counts_its_predecessor_left(
    server: FaultyServer, patient_guard: RedisGuard
) -> None:
    old = RedisLoadStore(patient_guard, namespace=NS, replica="router-0")
    await old.begin("pod-a", 100)
    await old.begin("pod-b", 100)
    # "crashes": a new process with the same replica name starts
    new = RedisLoadStore(patient_guard, namespace=NS, replica="router-0")
    await new.begin("pod-c", 1)
    assert await new.snapshot() == {"pod-c": (1, 1)}
    await new.close()


# -- the epoch -----------------------------------------------------------------------------------


async def test_the_epoch_is_created_once_and_changes_when_redis_loses_its_data(
    server: FaultyServer, patient_guard: RedisGuard
) -> None:
    index = RedisIndex(patient_guard, namespace=NS)
    other = RedisIndex(patient_guard, namespace="elsewhere")
    assert await index.epoch() is None
    first, concurrent = await asyncio.gather(index.ensure_epoch(), index.ensure_epoch())
    assert first == concurrent  # two writers starting together agree
    assert await index.ensure_epoch() == first
    assert await index.epoch() == first
    assert await other.ensure_epoch() != first  # one epoch per namespace
    server.kill()
    server.restart()  # lost everything
    await wait_until(lambda: serves(index), "Redis back", timeout=10)
    assert await index.epoch() is None
    second = await index.ensure_epoch()
    assert second != first


async def _ok(coro: Awaitable[Any]) -> bool:
    try:
        await coro
        return True
    except SharedStateUnavailable:
        return False


async def _equals(coro: Awaitable[Any], expected: object) -> bool:
    try:
        return bool(await coro == expected)
    except SharedStateUnavailable:
        return False
