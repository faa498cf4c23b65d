"""The gRPC server the EPP runs on, as a parameter: tests that use the ``grpc_server``
fixture run once on each (``kvroute epp --grpc-server``)."""

from __future__ import annotations

import pytest

from router.epp.fronts import SERVERS
from tests.epp import fleet


@pytest.fixture(params=SERVERS)
def grpc_server(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """``running_epp`` starts its EPP on this server."""
    server: str = request.param
    monkeypatch.setattr(fleet, "GRPC_SERVER", server)
    return server
