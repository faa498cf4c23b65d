"""The ``rig`` fixture of the router's API tests (tests/router/app_rig.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.router.app_rig import Rig, running, sim


@pytest.fixture
async def rig() -> AsyncIterator[Rig]:
    """Two simulated pods (the second also serves the ``sql-lora`` adapter) and a router."""
    async with running([sim(0), sim(1, lora_adapters=["sql-lora"])]) as r:
        yield r
