"""Redis over TLS (`rediss://`, the CA in the URL's `ssl_ca_certs`): a real redis-server with only a TLS
port and a certificate from a CA made here; the worker, a gateway and the SDK serve a request through it,
and a client that does not trust the CA cannot connect."""

from __future__ import annotations

import datetime as dt
import ipaddress
import subprocess
import time

import openai
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from producer_sdk import Client
from producer_sdk.contract.connection import connect
from tests.gateway.gateway_proc import GatewayProc
from tests.service.worker_proc import WorkerProc
from worker.service.redis_proc import free_port

pytestmark = [pytest.mark.single_node]


def _cert(subject: str, key, issuer_key=None, issuer_name=None, ca: bool = False) -> x509.Certificate:
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)])
    now = dt.datetime.now(dt.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(issuer_name or name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
        builder = builder.add_extension(san, critical=False)
    return builder.sign(issuer_key or key, hashes.SHA256())


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    """A redis-server listening on TLS only; yields (url with the CA, url without it)."""
    d = tmp_path_factory.mktemp("tls")
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = _cert("pagedq test CA", ca_key, ca=True)
    server = _cert("127.0.0.1", key, issuer_key=ca_key, issuer_name=ca.subject)
    (d / "ca.crt").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (d / "server.crt").write_bytes(server.public_bytes(serialization.Encoding.PEM))
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    (d / "server.key").write_bytes(pem)
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", "0", "--tls-port", str(port), "--tls-cert-file", str(d / "server.crt"),
         "--tls-key-file", str(d / "server.key"), "--tls-ca-cert-file", str(d / "ca.crt"),
         "--tls-auth-clients", "no", "--save", "", "--appendonly", "no", "--dir", str(d)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={d / 'ca.crt'}"
    deadline = time.monotonic() + 10
    while True:
        try:
            if connect(url, asyncio=False, socket_timeout=2).ping():
                break
        except Exception:
            if time.monotonic() > deadline:
                proc.kill()
                raise
            time.sleep(0.05)
    yield url, f"rediss://127.0.0.1:{port}/0"
    proc.kill()
    proc.wait()


def test_worker_gateway_and_sdk_over_tls(llama_dir, tls_redis):
    url, untrusted = tls_redis
    worker = WorkerProc(llama_dir, url, "--max-model-len", "256").start()
    gw = GatewayProc(url).start()
    try:
        with Client(url) as sdk:
            assert sdk.generate("over tls", max_tokens=3, temperature=0).finish_reason == "length"
        chat = openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0).chat.completions.create(
            model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert chat.choices[0].finish_reason == "length"
    finally:
        gw.stop()
        worker.stop()
    with pytest.raises(Exception, match=r"certificate verify failed|SSL|ssl"):  # not trusting the CA
        connect(untrusted, asyncio=False, socket_timeout=2).ping()
