"""Redis AUTH (a password, an ACL user) and TLS (rediss:// with a CA file) for the
router's shared state and `kvroute index`, against a real valkey-server."""

from __future__ import annotations

import ssl
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme

from router.config import Settings
from router.shared_state import make_guard
from tests.support.redis_server import start_server, stop_server
from tests.support.tls_relay import TLSRelay
from tests.tenants.rig import KEY_A, MODEL, auth, fleet, router, settings_for, sim, two_tenants

PASSWORD = "valkey-password-0123456789"


@pytest.fixture
def auth_server() -> Iterator[int]:
    """A valkey-server wanting a password (default user) and with an ACL user ``kvr``."""
    with tempfile.TemporaryDirectory(prefix="kvroute-auth-") as tmp:
        acl = Path(tmp) / "users.acl"
        acl.write_text(
            f"user default on >{PASSWORD} ~* &* +@all\nuser kvr on >{PASSWORD}-kvr ~* &* +@all\n"
        )
        proc, port = start_server(tmp, "--aclfile", str(acl))
        try:
            yield port
        finally:
            stop_server(proc)


def secret_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "redis-password"
    path.write_text(text + "\n")  # a mounted Secret often ends with a newline
    return str(path)


async def ping(settings: Settings) -> bool:
    guard = make_guard(settings)
    try:
        return bool(await guard.call("ping", guard.client.ping, request=False))
    finally:
        await guard.aclose()


async def test_the_password_file_authenticates_and_without_it_redis_refuses(
    auth_server: int, tmp_path: Path
) -> None:
    url = f"redis://127.0.0.1:{auth_server}/0"
    good = Settings(redis_url=url, redis_password_file=secret_file(tmp_path, PASSWORD))
    assert await ping(good)
    with pytest.raises(Exception, match=r"(?i)auth"):
        await ping(Settings(redis_url=url))


async def test_an_acl_user_authenticates_with_its_own_password(
    auth_server: int, tmp_path: Path
) -> None:
    settings = Settings(
        redis_url=f"redis://127.0.0.1:{auth_server}/0",
        redis_username="kvr",
        redis_password_file=secret_file(tmp_path, f"{PASSWORD}-kvr"),
    )
    assert await ping(settings)


async def test_limits_are_shared_through_an_authenticated_redis(
    auth_server: int, tmp_path: Path, redis_namespace: str
) -> None:
    shared: dict[str, Any] = {
        "redis_url": f"redis://127.0.0.1:{auth_server}/0",
        "redis_password_file": secret_file(tmp_path, PASSWORD),
        "redis_namespace": redis_namespace,
    }
    limits = {"requests_per_minute": 2}
    async with fleet([sim(0)]) as pods:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        s = settings_for(pods, **shared, **two_tenants(limits=limits))
        async with router(s) as one, router(s) as two:
            codes = [
                (await c.post("/v1/chat/completions", json=body, headers=auth(KEY_A))).status_code
                for c in (one, two, one)
            ]
        assert codes == [200, 200, 429]
        guard = make_guard(Settings(**{k: v for k, v in shared.items() if k != "redis_namespace"}))
        try:
            keys = await guard.client.keys(f"{redis_namespace}:tl:a:*")
        finally:
            await guard.aclose()
        assert keys  # the buckets are in Redis, so the replicas shared them


async def test_rediss_verifies_the_server_against_the_ca_file(
    redis_url: str, tmp_path: Path
) -> None:
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    plain_port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    async with TLSRelay(plain_port, server_ctx) as relay:
        url = f"rediss://127.0.0.1:{relay.port}/0"
        assert await ping(Settings(redis_url=url, redis_ca_file=str(ca_file)))
        with pytest.raises(Exception, match=r"(?i)certificate|ssl"):
            await ping(Settings(redis_url=url))  # the system store does not know this CA


def test_a_ca_file_without_a_tls_url_is_a_configuration_error(tmp_path: Path) -> None:
    ca_file = tmp_path / "ca.pem"
    trustme.CA().cert_pem.write_to_path(str(ca_file))
    with pytest.raises(ValueError, match="rediss://"):
        Settings(redis_url="redis://127.0.0.1:6379/0", redis_ca_file=str(ca_file))
