"""Reading a response stream through dropped connections and Redis restarts."""

from __future__ import annotations

import asyncio

import pytest
import redis
from sdk_fake_worker import FakeWorker, wait_for

from producer_sdk import AsyncClient, Client, ConnectionLost, RequestLost
from producer_sdk.contract import keys
from producer_sdk.sync import SyncHandle
from worker.service.redis_proc import free_port

MODEL = "default"


def blocked_readers(admin: redis.Redis) -> int:
    """Connections blocked in XREAD right now (the SDK's readers, not the worker's XREADGROUP)."""
    return sum(
        1
        for line in admin.execute_command("CLIENT", "LIST", "TYPE", "normal").decode().splitlines()
        if " cmd=xread " in f" {line} " and "flags=b" in line
    )


@pytest.fixture
def admin(redis_url):
    r = redis.Redis.from_url(redis_url)
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
        killed = admin.execute_command("CLIENT", "KILL", "TYPE", "normal")
        assert killed >= 1
        worker.resume.set()
        await asyncio.wait_for(reader, 10)
    assert [c.token_ids[0] for c in chunks] == list(range(7))  # none lost, none repeated
    assert [c.seq for c in chunks] == list(range(1, 8))
    assert handle.reconnects >= 1 and handle.finish_reason == "length"


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
        admin.execute_command("CLIENT", "KILL", "TYPE", "normal")
        worker.resume.set()
        await asyncio.wait_for(reader, 10)
        client.close()
    assert [c.token_ids[0] for c in chunks] == list(range(5))


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


async def test_redis_restart_before_any_token_resubmits(redis_server, redis_url):
    async with AsyncClient(redis_url, MODEL, block_ms=100) as client:
        handle = await client.submit("x", max_tokens=3)
        reader = asyncio.ensure_future(handle.result(timeout=20))
        admin = redis.Redis.from_url(redis_url)
        await wait_for(lambda: blocked_readers(admin) == 1, what="a blocked reader")
        admin.close()
        await asyncio.to_thread(redis_server.restart)  # the queued request is gone with the data
        async with FakeWorker(redis_url) as worker:
            done = await asyncio.wait_for(reader, 20)
    assert done.token_ids == [0, 1, 2] and handle.resubmits == 1
    assert [r.request_id for r in worker.requests] == [handle.request_id]


async def test_connection_lost_after_the_attempts():
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    async with AsyncClient(url, reconnect_attempts=2, reconnect_backoff_max_s=0.01, connect_timeout=1) as c:
        with pytest.raises(ConnectionLost) as info:
            await c.submit("x")
    assert info.value.attempts == 2 and isinstance(info.value, ConnectionError)
    with Client(url, reconnect_attempts=1, reconnect_backoff_max_s=0.01) as c, pytest.raises(ConnectionLost):
        c.queue_stats()


async def test_lost_request_without_resubmit(redis_server, redis_url):
    """A restart while a request waits in its lane loses it with its marker; with
    resubmit_lost=False the reader says so. (With persistence the marker survives and it waits.)"""
    async with AsyncClient(redis_url, MODEL, block_ms=50, resubmit_lost=False) as client:
        handle = await client.submit("x")
        await asyncio.to_thread(redis_server.restart)
        with pytest.raises(RequestLost, match="resubmit_lost is off"):
            await handle.result(timeout=10)
        assert not await client.redis.exists(keys.submitted_marker(handle.request_id))
