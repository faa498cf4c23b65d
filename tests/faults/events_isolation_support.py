"""The ZMQ context fixture of the ``test_events_isolation_*.py`` files (isolated KV-event
ingestion, issue #10): one context per test, with the events' log rate limits reset.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio

from router.events.ratelimit import reset as reset_log_limits


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    reset_log_limits()
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)
