"""Credentials in URLs, ACL users restricted to pagedq keys, and TLS (rediss://)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis
from redis.asyncio.connection import SSLConnection as AsyncSSLConnection
from sdk_fake_worker import FakeWorker

from producer_sdk import AsyncClient, AuthenticationFailed, Client, PermissionDenied, tenants
from producer_sdk.contract.connection import connect
from worker.service.redis_proc import RedisProcess, free_port

pytestmark = pytest.mark.single_node  # ACL users made on one server

MODEL = "default"
# Exactly what the SDK needs (docs/sdk.md's ACL; tests/unit/test_docs_claims.py runs that line itself):
# keys and channels under pagedq:.
SDK_COMMANDS = [
    "+@connection", "+evalsha", "+script|load", "+xread", "+xrange", "+exists", "+set",
    "+publish", "+xlen", "+zrange", "+zrem", "+mget", "+hget", "+xadd",
    "+hmget", "+hincrby", "+hset", "+pexpire", "+time",  # what the enqueue step runs inside Redis
]  # fmt: skip


@pytest.fixture
def acl_user(redis_url):
    admin = connect(redis_url, asyncio=False, socket_timeout=10)
    users = []

    def make(name: str, password: str, keys: str = "~pagedq:*", channels: str = "&pagedq:*") -> str:
        admin.execute_command("ACL", "SETUSER", name, "reset", "on", f">{password}", keys, channels, *SDK_COMMANDS)
        users.append(name)
        parts = urlsplit(redis_url)
        return f"redis://{name}:{password}@{parts.hostname}:{parts.port}/0"

    yield make
    for name in users:
        if admin.ping():
            admin.execute_command("ACL", "DELUSER", name)
    admin.close()


async def test_acl_user_restricted_to_pagedq_keys(redis_url, acl_user):
    url = acl_user("agent", "s3cret-pw")
    async with FakeWorker(redis_url), AsyncClient(url, MODEL) as client:
        assert await client.ping()
        done = await client.generate("x", max_tokens=2, timeout=5)
        assert done.token_ids == [0, 1]
        handle = await client.submit("y", max_tokens=1)
        await client.cancel(handle.request_id)
        assert (await client.queue_stats()).model == MODEL
        # a key outside pagedq:* is really off limits for this user
        with pytest.raises(redis.exceptions.NoPermissionError):
            await client.redis.get("other:key")
    admin = connect(redis_url, asyncio=False, socket_timeout=10)
    tenants.set_quota(admin, "team-a", max_queued=100, requests_per_minute=100, tokens_per_minute=100)  # all run
    admin.close()
    with Client(url, MODEL, tenant="team-a") as sync_client:
        assert sync_client.submit("z").entry_id


async def test_wrong_password_is_a_clear_error(redis_url, acl_user):
    url = acl_user("agent", "right-password").replace("right-password", "wrong-password")
    async with AsyncClient(url, MODEL) as client:
        with pytest.raises(AuthenticationFailed, match="credentials"):
            await client.submit("x")
    with Client(url, MODEL) as sync_client, pytest.raises(AuthenticationFailed):
        sync_client.ping()


async def test_acl_without_pagedq_keys_is_permission_denied(acl_user):
    url = acl_user("tenant_b", "pw-b", keys="~pagedq:{tenant-b}:*", channels="&pagedq:{tenant-b}:*")
    async with AsyncClient(url, "tenant-a") as client:
        with pytest.raises(PermissionDenied, match="ACL"):
            await client.submit("x")


def test_rediss_url_and_ssl_options_are_passed_through(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("unused")
    client = AsyncClient("rediss://agent:pw@redis.example:6380/2", MODEL, ssl_ca_certs=str(ca))
    pool = client.redis.connection_pool
    assert pool.connection_class is AsyncSSLConnection
    kw = pool.connection_kwargs
    assert (kw["host"], kw["port"], kw["db"]) == ("redis.example", 6380, 2)
    assert (kw["username"], kw["password"], kw["ssl_ca_certs"]) == ("agent", "pw", str(ca))
    sync_client = Client("rediss://redis.example:6380/0?ssl_cert_reqs=required", MODEL)
    assert sync_client.redis.connection_pool.connection_class is redis.SSLConnection
    assert sync_client.redis.connection_pool.connection_kwargs["ssl_cert_reqs"] == "required"


def _self_signed(dir: Path) -> tuple[Path, Path]:
    cert, key = dir / "cert.pem", dir / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return cert, key


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
async def test_real_tls_server(tmp_path):
    cert, key = _self_signed(tmp_path)
    tls_port = free_port()
    args = ["--tls-port", str(tls_port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
            "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"]  # fmt: skip
    try:
        server = RedisProcess(data_dir=tmp_path / "data", extra_args=args).start()
    except RuntimeError as e:  # a redis-server built without TLS
        pytest.skip(f"redis-server has no TLS: {e}")
    try:
        url = f"rediss://127.0.0.1:{tls_port}/0"
        async with FakeWorker(server.url), AsyncClient(url, MODEL, ssl_ca_certs=str(cert)) as client:
            assert (await client.generate("x", max_tokens=2, timeout=5)).token_ids == [0, 1]
        with Client(url, MODEL, ssl_ca_certs=str(cert)) as sync_client:
            assert sync_client.submit("y").entry_id
    finally:
        server.cleanup()
