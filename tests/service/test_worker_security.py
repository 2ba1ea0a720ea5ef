"""Security against a real worker: tenants isolated by the per-tenant ACL users of `pagedq acl`, and TLS."""

from __future__ import annotations

import shutil
from urllib.parse import urlsplit

import pytest
import redis

from producer_sdk import Client, PermissionDenied, tenants
from producer_sdk.contract import acl as acl_rules
from producer_sdk.contract import keys
from producer_sdk.contract.connection import connect
from tests.service.worker_proc import WorkerProc, wait_until
from worker.service.redis_proc import RedisProcess, free_port

pytestmark = pytest.mark.single_node  # ACL users and TLS on one server


@pytest.fixture
def acl(redis_url):
    """Creates a user with the rules `pagedq acl` writes for a role (`narrow`: its --model-name/--tenant)."""
    admin = connect(redis_url, asyncio=False, socket_timeout=10)
    parts = urlsplit(redis_url)

    def user(role: str, name: str, password: str, **narrow) -> str:
        admin.execute_command("ACL", "SETUSER", name, *acl_rules.rules(role, password, **narrow))
        return f"redis://{name}:{password}@{parts.hostname}:{parts.port}/0"

    yield user
    for name in admin.execute_command("ACL", "USERS"):
        if name not in (b"default", "default"):
            admin.execute_command("ACL", "DELUSER", name)
    admin.close()


def test_per_tenant_users_isolate_tenants(llama_dir, redis_url, acl):
    """ops/README.md's per-tenant producers: a model name and a tenant each (`pagedq acl --role producer
    --model-name tenant-a --tenant tenant-a`); tenant-b may not write into tenant-a's queue."""
    worker_url = acl("worker", "pagedq-worker", "worker-pw")
    tenant_a = acl("producer", "tenant-a", "pw-a", models=["tenant-a"], tenant="tenant-a")
    tenant_b = acl("producer", "tenant-b", "pw-b", models=["tenant-b"], tenant="tenant-b")
    admin = connect(redis_url, asyncio=False, socket_timeout=10)
    tenants.set_quota(admin, "tenant-a", tokens_per_minute=10_000)  # the worker's ack counts tokens
    w = WorkerProc(llama_dir, worker_url, model="tenant-a", metrics=False).start()
    try:
        with Client(tenant_a, model="tenant-a", tenant="tenant-a") as a:
            res = a.generate("hello from a", max_tokens=5, temperature=0, ignore_eos=True, timeout=60)
            assert res.finish_reason == "length" and len(res.token_ids) == 5
        counted = lambda: admin.hget(keys.tenant_tokens("tenant-a", "tenant-a"), "n")  # by the ack, just after
        used = int(wait_until(counted, 10, "the ack's token count"))
        assert used == res.usage.prompt_tokens + res.usage.completion_tokens
        with Client(tenant_b, model="tenant-a", tenant="tenant-b") as b, pytest.raises(PermissionDenied):
            b.submit("b writes into a's queue", max_tokens=5)
        raw_b = connect(tenant_b, asyncio=False, socket_timeout=10)
        with pytest.raises(redis.exceptions.NoPermissionError):
            raw_b.scan(0)  # request ids cannot be listed
        with pytest.raises(redis.exceptions.NoPermissionError):
            raw_b.keys("pagedq:*")
        raw_b.close()
    finally:
        w.stop()
        admin.close()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_worker_and_sdk_over_tls(llama_dir, tmp_path):
    from tests.service.test_sdk_auth import _self_signed

    cert, key = _self_signed(tmp_path)
    tls_port = free_port()
    args = ["--tls-port", str(tls_port), "--tls-cert-file", str(cert), "--tls-key-file", str(key)]
    args += ["--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"]
    try:  # the plain port only serves the fixture's readiness check; everything below uses TLS
        server = RedisProcess(data_dir=tmp_path / "data", extra_args=args).start()
    except RuntimeError as e:  # a redis-server built without TLS
        pytest.skip(f"redis-server has no TLS support: {e}")
    url = f"rediss://127.0.0.1:{tls_port}/0?ssl_ca_certs={cert}&ssl_cert_reqs=required"
    w = WorkerProc(llama_dir, url, metrics=False)
    try:
        w.start()
        with Client(f"rediss://127.0.0.1:{tls_port}/0", ssl_ca_certs=str(cert)) as client:
            res = client.generate("over TLS", max_tokens=4, temperature=0, ignore_eos=True, timeout=60)
        assert len(res.token_ids) == 4 and res.worker == "w1"
    finally:
        w.stop()
        server.cleanup()
