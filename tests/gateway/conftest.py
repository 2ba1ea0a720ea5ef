"""One redis database, one real worker (tiny Llama, every step at least 10 ms so that streams can be
cut mid-generation; pagedq's Hermes tool template, which renders a chat without tools exactly as the
tiny model's own template does) and one gateway process, shared by every test of tests/gateway.

These tests never use the `redis_url` fixture (it flushes the server); they clean up after
themselves instead, and measure worker metrics as differences.
"""

from __future__ import annotations

import pytest

from producer_sdk.contract.connection import connect
from tests.gateway.gateway_proc import GatewayProc
from tests.redis_target import ON_CLUSTER
from tests.service.worker_proc import WorkerProc
from worker.models.chat_templates import HERMES_TOOLS

STEP_DELAY_S = "0.01"
MAX_MODEL_LEN = 1024  # a chat with a tool: about 500 prompt tokens of the tiny tokenizer


@pytest.fixture(scope="package")
def gw_redis_url(request) -> str:
    """The session's redis-server, emptied once (or, in the cluster pass, the session's cluster)."""
    if ON_CLUSTER:
        cluster = request.getfixturevalue("redis_cluster")
        cluster.flushall()
        return cluster.url
    redis_server = request.getfixturevalue("redis_server")
    if not redis_server.ping():
        redis_server.start()
    client = connect(redis_server.url, asyncio=False, socket_timeout=10)
    client.flushall()
    client.close()
    return redis_server.url


@pytest.fixture(scope="package")
def gw_spans(tmp_path_factory):
    """Where the shared worker's `--otel-traces-file` exporter writes its spans (JSON lines)."""
    return tmp_path_factory.mktemp("gw-spans") / "spans.jsonl"


@pytest.fixture(scope="package")
def gw_worker(llama_dir, gw_redis_url, gw_spans):
    w = WorkerProc(
        llama_dir,
        gw_redis_url,
        "--max-num-seqs",
        "64",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--chat-template",
        str(HERMES_TOOLS),
        "--otel-traces-file",
        str(gw_spans),
        env={"PAGEDQ_FAULT_STEP_DELAY_S": STEP_DELAY_S, "OTEL_BSP_SCHEDULE_DELAY": "50"},
    ).start()
    yield w
    w.stop()


@pytest.fixture(scope="package")
def gateway(gw_worker, gw_redis_url):
    g = GatewayProc(gw_redis_url).start()
    yield g
    g.stop()


@pytest.fixture(scope="package")
def offline(llama_dir):
    from worker import LLM

    return LLM(model=str(llama_dir), dtype="float32", device="cpu", chat_template=str(HERMES_TOOLS))


@pytest.fixture
def r(gw_redis_url):
    client = connect(gw_redis_url, asyncio=False, socket_timeout=10)
    yield client
    client.close()
