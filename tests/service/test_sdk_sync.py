"""The blocking Client (redis-py's sync client), run in a thread next to the async fake worker."""

from __future__ import annotations

import asyncio

import pytest
from sdk_fake_worker import FakeWorker, wait_for

from producer_sdk import Cancelled, Client, QueueFull, RequestFailed, RequestTimeout
from producer_sdk.contract import keys
from producer_sdk.contract.connection import connect

MODEL = "default"


@pytest.fixture
def client(redis_url):
    with Client(redis_url, MODEL, block_ms=200) as c:
        yield c


async def test_generate_stream_result(redis_url, client):
    async with FakeWorker(redis_url):
        done = await asyncio.to_thread(client.generate, "Hi", max_tokens=3, timeout=5)
        assert done.text == "w0 w1 w2 " and done.finish_reason == "length"

        def stream():
            return [c.text for c in client.stream(messages=[{"role": "user", "content": "x"}], max_tokens=2)]

        assert await asyncio.to_thread(stream) == ["w0 ", "w1 "]

        handle = await asyncio.to_thread(client.submit, "x", n=2, max_tokens=1)
        done = await asyncio.to_thread(handle.result, 5)
        assert [c.token_ids for c in done.choices] == [[0], [1000]]
        assert handle.finish_reason == "length" and handle.usage.completion_tokens == 2
        twin = client.handle(handle.request_id)  # re-attach, read from the start
        assert await asyncio.to_thread(twin.result, 5) == done


async def test_idempotent_and_submit_many(redis_url, client):
    admin = connect(redis_url, asyncio=False, socket_timeout=10)
    a = client.submit("x", request_id="sync_request_1")
    b = client.submit("x", request_id="sync_request_1")
    assert b.duplicate and admin.xlen(keys.lane_stream(MODEL)) == 1
    admin.hset(keys.config(MODEL), "max_queue_len", 3)
    with pytest.raises(QueueFull) as info:
        client.submit_many(["p", "q", "r"], max_tokens=1)
    assert [h is not None for h in info.value.handles] == [True, True, False]
    admin.close()
    async with FakeWorker(redis_url):
        assert (await asyncio.to_thread(a.result, 5)) == (await asyncio.to_thread(b.result, 5))
        stats = await asyncio.to_thread(client.queue_stats)
    assert stats.queued == 0


async def test_cancel_timeout_failure(redis_url, client):
    handle = client.submit("x")
    with pytest.raises(RequestTimeout):
        handle.result(timeout=0.1)
    async with FakeWorker(redis_url, token_delay=0.005) as worker:
        forever = client.submit("forever")

        def read_then_cancel():
            for i, _ in enumerate(forever.stream(timeout=10)):
                if i == 0:
                    forever.cancel()

        with pytest.raises(Cancelled):
            await asyncio.to_thread(read_then_cancel)

        def break_early():
            for _ in client.stream("forever"):
                break  # the generator is closed right here (refcount), which cancels

        await asyncio.to_thread(break_early)
        await wait_for(lambda: list(worker.finished.values()).count("abort") == 2, what="the abort")
        with pytest.raises(RequestFailed, match="boom"):
            await asyncio.to_thread(client.generate, "fail", timeout=5)
