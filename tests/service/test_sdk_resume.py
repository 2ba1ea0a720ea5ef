"""Reading a response stream through dropped connections and Redis restarts."""

from __future__ import annotations

import asyncio

import pytest
import redis
from sdk_fake_worker import FakeWorker, wait_for

from producer_sdk import AsyncClient, Client, ConnectionLost, RequestLost, RequestTimeout
from producer_sdk.contract import keys
from producer_sdk.contract.cluster import is_cluster
from producer_sdk.contract.connection import connect
from producer_sdk.sync import SyncHandle
from worker.service.redis_proc import free_port

MODEL = "default"


def blocked_readers(admin: redis.Redis) -> int:
    """Connections blocked in XREAD right now (the SDK's readers, not the worker's XREADGROUP), on
    every node of a cluster."""
    if is_cluster(admin):
        lists = [admin.execute_command("CLIENT", "LIST", "TYPE", "normal", target_nodes=n) for n in admin.get_nodes()]
    else:
        lists = [admin.execute_command("CLIENT", "LIST", "TYPE", "normal")]
    lines = [line for text in lists for line in _text(text).splitlines()]
    return sum(1 for line in lines if " cmd=xread " in f" {line} " and "flags=b" in line)


def kill_clients(admin) -> int:
    """CLIENT KILL TYPE normal on the server, or on every node of a cluster: the connections drop."""
    if is_cluster(admin):
        return sum(admin.execute_command("CLIENT", "KILL", "TYPE", "normal", target_nodes=n) for n in admin.get_nodes())
    return admin.execute_command("CLIENT", "KILL", "TYPE", "normal")


def _text(x) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


@pytest.fixture
def admin(redis_url):
    r = connect(redis_url, asyncio=False, socket_timeout=10)
    yield r
    r.close()


async def test_resume_after_client_kill(redis_url, admin):
    async with FakeWorker(redis_url, pause_after=3) as worker, AsyncClient(redis_url, MODEL) as client:
        handle = await client.submit("x", max_tokens=7)
        chunks = []

        async def read():
            async for c in handle.stream(timeout=10):
                chunks.append(c)

        reader = asyncio.ensure_future(read())
        await wait_for(lambda: len(chunks) == 3 and blocked_readers(admin) == 1, what="a blocked reader")
        killed = kill_clients(admin)
        assert killed >= 1
        worker.resume.set()
        await asyncio.wait_for(reader, 10)
    assert [c.token_ids[0] for c in chunks] == list(range(7))  # none lost, none repeated
    assert [c.seq for c in chunks] == list(range(1, 8))
    assert handle.finish_reason == "length"
    if not is_cluster(admin):  # redis-py's asyncio cluster client may resend the XREAD once itself
        assert handle.reconnects >= 1


async def test_sync_resume_after_client_kill(redis_url, admin):
    async with FakeWorker(redis_url, pause_after=2) as worker:
        client = Client(redis_url, MODEL)
        handle: SyncHandle = await asyncio.to_thread(client.submit, "x", max_tokens=5)
        chunks = []

        def read():
            for c in handle.stream(timeout=10):
                chunks.append(c)

        reader = asyncio.ensure_future(asyncio.to_thread(read))
        await wait_for(lambda: len(chunks) == 2 and blocked_readers(admin) == 1, what="a blocked reader")
        kill_clients(admin)
        worker.resume.set()
        await asyncio.wait_for(reader, 10)
        client.close()
    assert [c.token_ids[0] for c in chunks] == list(range(5))


@pytest.mark.single_node
async def test_redis_restart_mid_stream(redis_server, redis_url):
    """Without persistence a restart loses the request and its stream: a reader that has streamed
    tokens must say so (RequestLost) instead of hanging or restarting the text; nothing it had
    delivered is repeated, and the client works again right after."""
    async with FakeWorker(redis_url, pause_after=2) as worker, AsyncClient(redis_url, MODEL) as client:
        handle = await client.submit("x", max_tokens=5)
        chunks = []

        async def read():
            async for c in handle.stream(timeout=20):
                chunks.append(c)

        reader = asyncio.ensure_future(read())
        await wait_for(lambda: len(chunks) == 2, what="two chunks")
        await asyncio.to_thread(redis_server.restart)
        with pytest.raises(RequestLost, match="tokens were already streamed"):
            await asyncio.wait_for(reader, 20)
        assert [c.token_ids[0] for c in chunks] == [0, 1]
        assert handle.reconnects >= 1

        worker.pause_after = None
        worker.resume.set()
        done = await client.generate("again", max_tokens=3, timeout=10)  # groups recreated by the worker
        assert done.token_ids == [0, 1, 2]


@pytest.mark.single_node
async def test_redis_restart_before_any_token_resubmits(redis_server, redis_url):
    async with AsyncClient(redis_url, MODEL, block_ms=100) as client:
        handle = await client.submit("x", max_tokens=3)
        reader = asyncio.ensure_future(handle.result(timeout=20))
        admin = connect(redis_url, asyncio=False, socket_timeout=10)
        await wait_for(lambda: blocked_readers(admin) == 1, what="a blocked reader")
        admin.close()
        await asyncio.to_thread(redis_server.restart)  # the queued request is gone with the data
        async with FakeWorker(redis_url) as worker:
            done = await asyncio.wait_for(reader, 20)
    assert done.token_ids == [0, 1, 2] and handle.resubmits == 1
    assert [r.request_id for r in worker.requests] == [handle.request_id]


async def test_a_request_queued_past_its_marker_is_not_resubmitted(redis_url):
    """The marker expires after the result TTL even while the request waits in its lane; the entry
    still there says it is queued, so the reader waits instead of enqueueing it a second time."""
    async with AsyncClient(redis_url, MODEL, block_ms=50) as client:
        with Client(redis_url, MODEL, block_ms=50) as sync_client:
            handles = [await client.submit("x", max_tokens=3), await asyncio.to_thread(sync_client.submit, "y")]
            for h in handles:  # as if their markers expired
                await client.redis.delete(keys.submitted_marker(MODEL, h.request_id))
            with pytest.raises(RequestTimeout):
                await handles[0].result(timeout=0.5)  # about ten liveness checks
            with pytest.raises(RequestTimeout):
                await asyncio.to_thread(handles[1].result, timeout=0.5)
            assert [h.resubmits for h in handles] == [0, 0]
            assert await client.redis.xlen(keys.lane_stream(MODEL, "normal")) == 2
        async with FakeWorker(redis_url) as worker:
            done = await handles[0].result(timeout=20)
    assert done.token_ids == [0, 1, 2] and handles[0].request_id in [r.request_id for r in worker.requests]


async def test_connection_lost_after_the_attempts():
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    async with AsyncClient(url, reconnect_attempts=2, reconnect_backoff_max_s=0.01, connect_timeout=1) as c:
        with pytest.raises(ConnectionLost) as info:
            await c.submit("x")
    assert info.value.attempts == 2 and isinstance(info.value, ConnectionError)
    with Client(url, reconnect_attempts=1, reconnect_backoff_max_s=0.01) as c, pytest.raises(ConnectionLost):
        c.queue_stats()


@pytest.mark.single_node
async def test_lost_request_without_resubmit(redis_server, redis_url):
    """A restart while a request waits in its lane loses it with its marker; with
    resubmit_lost=False the reader says so. (With persistence the marker survives and it waits.)"""
    async with AsyncClient(redis_url, MODEL, block_ms=50, resubmit_lost=False) as client:
        handle = await client.submit("x")
        await asyncio.to_thread(redis_server.restart)
        with pytest.raises(RequestLost, match="resubmit_lost is off"):
            await handle.result(timeout=10)
        assert not await client.redis.exists(keys.submitted_marker(handle.model, handle.request_id))
