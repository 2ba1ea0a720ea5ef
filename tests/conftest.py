"""Fixtures every test layer shares: a real redis-server, tiny HF models, the real SmolLM2.

Environment knobs are set here, at import, before any test module defines a Triton kernel or
starts torch's thread pool.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("OMP_NUM_THREADS", "1")

from pathlib import Path

import pytest

try:
    import torch

    torch.set_num_threads(1)
except ImportError:  # the SDK-only install has no torch
    torch = None

from tests.redis_target import ON_CLUSTER
from worker.models.tiny import FAMILIES
from worker.service.redis_proc import RedisProcess

# ON_CLUSTER (`PAGEDQ_TEST_REDIS=cluster`, the cluster pass of `make test`, with redis-py >= 6): every
# test that takes `redis_url` runs against a real local Redis Cluster (3 masters + 3 replicas) instead
# of one redis-server. Tests marked `single_node` (they restart the server, create ACL users on it,
# ...) are left out of that pass, and tests marked `cluster` (they start clusters of their own) run
# only in it: left out, not skipped.


def pytest_collection_modifyitems(config, items):
    has_cuda = torch is not None and torch.cuda.is_available()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (none here)")
    for item in items:
        if item.get_closest_marker("gpu") and not has_cuda:
            item.add_marker(skip_gpu)
    other_pass = "single_node" if ON_CLUSTER else "cluster"
    left_out = [item for item in items if item.get_closest_marker(other_pass)]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if not item.get_closest_marker(other_pass)]


# --- Redis -------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def redis_server():
    """One real redis-server for the whole session, on a free port, keeping nothing on disk.

    Tests that kill or restart it call `redis_server.restart()`; the next test's `redis_url`
    fixture brings it back if a test left it down.
    """
    server = RedisProcess().start()
    yield server
    server.cleanup()


SERVED_MODELS = ("default",)  # the names producers may submit to without a worker having started


@pytest.fixture(scope="session")
def redis_cluster():
    """One real local Redis Cluster for the whole session (the cluster pass only)."""
    from tests.cluster_proc import RedisCluster

    with RedisCluster(appendonly=False) as cluster:
        yield cluster


@pytest.fixture
def redis_url(request) -> str:
    """URL of the session's Redis (one server, or the cluster in the cluster pass), empty at the start
    of each test, where the model "default" is already registered as served (as after a worker ran),
    so producers can enqueue before the test starts its worker."""
    import time

    from producer_sdk.contract import keys
    from producer_sdk.contract.connection import connect

    if ON_CLUSTER:
        cluster = request.getfixturevalue("redis_cluster")
        cluster.flushall()
        url = cluster.url
    else:
        server = request.getfixturevalue("redis_server")
        if not server.ping():
            server.start()
        url = server.url
        client = connect(url, asyncio=False, socket_timeout=10)
        client.flushall()
        client.close()
    client = connect(url, asyncio=False, socket_timeout=10)
    client.zadd(keys.models(), {m: int(time.time() * 1000) for m in SERVED_MODELS})
    client.close()
    return url


# --- Models ------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    """family -> folder of a tiny random-weight model (built once per session)."""
    from worker.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("tiny-models")
    return {fam: build_tiny_model(fam, root / fam, seed=i) for i, fam in enumerate(FAMILIES)}


@pytest.fixture(params=FAMILIES)
def tiny_model_dir(request, tiny_model_dirs) -> Path:
    """Parametrised over every tiny family."""
    return tiny_model_dirs[request.param]


@pytest.fixture(scope="session")
def llama_dir(tiny_model_dirs) -> Path:
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct as an HF folder (prepared once into the user cache)."""
    from worker.models.prepare import prepare

    return prepare("smollm2")
