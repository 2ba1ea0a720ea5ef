"""An AsyncClient sends the submits of one event-loop pass as one pipeline (producer_sdk._submit_batch),
and each submit still gets its own answer."""

from __future__ import annotations

import asyncio

import pytest

from producer_sdk import AsyncClient, ConnectionLost, ModelNotFound, QueueFull
from producer_sdk.contract import keys
from producer_sdk.contract.connection import connect
from worker.service.redis_proc import free_port

MODEL = "default"


@pytest.fixture
def admin(redis_url):
    r = connect(redis_url, asyncio=False, socket_timeout=10)
    yield r
    r.close()


def lane_ids(admin) -> list[str]:
    return [fields[b"id"].decode() for _, fields in admin.xrange(keys.lane_stream(MODEL))]


def connections_named(admin, name: str) -> int:
    lines = admin.execute_command("CLIENT", "LIST", "TYPE", "normal").decode().splitlines()
    return sum(1 for line in lines if f" name={name} " in line)


@pytest.mark.single_node  # reads CLIENT LIST of one server
async def test_gathered_submits_share_one_round_trip_and_keep_their_order(redis_url, admin):
    ids = [f"gathered-{i}" for i in range(16)]
    async with AsyncClient(redis_url, MODEL, client_name="batched-producer") as c:
        handles = await asyncio.gather(*(c.submit(f"prompt {i}", request_id=rid) for i, rid in enumerate(ids)))
        # Sent one at a time, concurrent submits each take a pooled connection of their own.
        assert connections_named(admin, "batched-producer") == 1
    assert [h.request_id for h in handles] == ids
    assert lane_ids(admin) == ids
    entry_ids = [entry.decode() for entry, _ in admin.xrange(keys.lane_stream(MODEL))]
    assert [h.entry_id for h in handles] == entry_ids and not any(h.duplicate for h in handles)


async def test_each_submit_of_a_batch_gets_its_own_answer(redis_url, admin):
    async with AsyncClient(redis_url, MODEL) as c:
        first, again = await asyncio.gather(
            c.submit("a", request_id="submitted-twice"), c.submit("b", request_id="submitted-twice")
        )
        assert not first.duplicate and again.duplicate and lane_ids(admin) == ["submitted-twice"]

    async with AsyncClient(redis_url, MODEL, max_queue_len=3) as c:
        results = await asyncio.gather(*(c.submit(f"p{i}") for i in range(5)), return_exceptions=True)
    full = [r for r in results if isinstance(r, QueueFull)]
    assert len(full) == 3 and all(f.limit == 3 for f in full)  # "submitted-twice" holds one place of the three
    assert [r.request_id for r in results[:2]] == lane_ids(admin)[1:]


async def test_a_submit_cancelled_before_its_batch_is_sent_sends_nothing(redis_url, admin):
    async with AsyncClient(redis_url, MODEL) as c:
        await c.ping()
        dropped = asyncio.ensure_future(c.submit("never", request_id="dropped-submit"))
        kept = asyncio.ensure_future(c.submit("kept-submit", request_id="kept-submit"))
        await asyncio.sleep(0)  # both submits now wait in the batcher; its flush comes next
        dropped.cancel()
        assert (await kept).request_id == "kept-submit"
        with pytest.raises(asyncio.CancelledError):
            await dropped
    assert lane_ids(admin) == ["kept-submit"]
    assert not admin.exists(keys.submitted_marker(MODEL, "dropped-submit"))


async def test_a_batch_failure_reaches_every_submit_in_it(redis_url, admin):
    async with AsyncClient(redis_url, "not-served") as c:
        results = await asyncio.gather(*(c.submit("x") for _ in range(3)), return_exceptions=True)
    assert all(isinstance(r, ModelNotFound) for r in results)
    assert admin.keys(keys.model_prefix("not-served") + "*") == []

    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    async with AsyncClient(url, reconnect_attempts=1, reconnect_backoff_max_s=0.01, connect_timeout=1) as c:
        submits = (c.submit("x", request_id=f"lost-request-{i}") for i in range(3))
        results = await asyncio.gather(*submits, return_exceptions=True)
    assert all(isinstance(r, ConnectionLost) for r in results)
    assert [r.request_id for r in results] == [f"lost-request-{i}" for i in range(3)]
