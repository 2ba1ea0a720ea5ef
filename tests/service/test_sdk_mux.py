"""The async client's shared reader (producer_sdk/_mux.py): one XREAD for all of its response streams."""

from __future__ import annotations

import asyncio

import pytest
import redis
from sdk_fake_worker import FakeWorker, wait_for
from test_sdk_resume import kill_clients

from producer_sdk import AsyncClient
from producer_sdk.contract import keys
from producer_sdk.contract.cluster import is_cluster
from producer_sdk.contract.connection import connect

MODEL = "default"


@pytest.fixture
def admin(redis_url):
    r = connect(redis_url, asyncio=False, socket_timeout=10)
    if is_cluster(r):
        pytest.skip("one XREAD reads one hash slot: on a cluster every reader reads on its own")
    yield r
    r.close()


def blocked_of(admin: redis.Redis, name: str) -> int:
    """Connections named `name` blocked in XREAD right now."""
    lines = admin.execute_command("CLIENT", "LIST", "TYPE", "normal").decode().splitlines()
    return sum(1 for line in lines if f" name={name} " in line and " cmd=xread " in line and "flags=b" in line)


def pool_size(client: AsyncClient) -> int:
    pool = client.redis.connection_pool
    return len(pool._available_connections) + len(pool._in_use_connections)


async def test_many_streams_share_one_blocked_read(redis_url, admin):
    """40 requests streamed at once: every token arrives, in order, and never more than one of the
    client's connections is blocked in XREAD (each reader used to block one of its own). The fake
    pauses all 40 halfway, so the shared read surely blocks (the wait asserts it) and the watch
    samples it blocked."""
    n, max_tokens, pause_at = 40, 12, 6
    fake = FakeWorker(redis_url, token_delay=0.002, pause_after=pause_at)
    async with fake, AsyncClient(redis_url, MODEL, client_name="mux") as client:
        handles = await client.submit_many([f"p{i}" for i in range(n)], max_tokens=max_tokens)
        most_blocked = 0
        done = asyncio.Event()

        async def watch() -> None:
            nonlocal most_blocked
            while not done.is_set():
                most_blocked = max(most_blocked, blocked_of(admin, "mux"))
                await asyncio.sleep(0.005)

        watcher = asyncio.ensure_future(watch())
        results = asyncio.ensure_future(asyncio.gather(*(h.result(timeout=30) for h in handles)))
        await wait_for(
            lambda: len(fake.emitted) == n and all(v == pause_at for v in fake.emitted.values()), 10, "the pause"
        )
        await wait_for(lambda: blocked_of(admin, "mux") == 1, 10, "the shared read to block")
        fake.resume.set()
        completions = await results
        done.set()
        await watcher
        expected = "".join(f"w{i} " for i in range(max_tokens))
        assert [c.text for c in completions] == [expected] * n
        assert all(c.finish_reason == "length" for c in completions)
        assert most_blocked == 1  # blocked once, halfway, and never by two connections
        assert pool_size(client) <= 3  # the shared read, submits, liveness checks (not one per reader)
        # Readers answered in one round register again before the next XREAD goes out, not through
        # a wake each (a wake per round before the read yielded to them: 232 wakes in 316 rounds).
        assert client._mux.rounds > 0 and client._mux.wakes <= 2


async def test_a_new_reader_wakes_the_blocked_read(redis_url, admin):
    """A reader that joins while the shared XREAD blocks on another, idle stream gets its entry at
    once, not when the 20 s slice ends: the client writes its wake stream."""
    async with AsyncClient(redis_url, MODEL, check_model=False) as client:
        mux = client._reader()
        idle = asyncio.ensure_future(mux.read("t:idle", b"0-0", 10, 20_000))
        await wait_for(lambda: mux._blocked, what="the shared read to block")
        joined = asyncio.ensure_future(mux.read("t:new", b"0-0", 10, 20_000))
        await wait_for(lambda: mux.wakes == 1, what="a wake")
        entry_id = admin.xadd("t:new", {"e": "x"})
        reply = await asyncio.wait_for(joined, 5)
        assert reply == [[b"t:new", [(entry_id, {b"e": b"x"})]]]
        assert not idle.done()
        wake_key = keys.reader_wake(MODEL, "")
        wakes = [k for k in admin.scan_iter(match=wake_key + "*")]
        assert len(wakes) == 1 and 0 < admin.pttl(wakes[0]) <= 60_000
        admin.xadd("t:idle", {"e": "y"})
        assert (await asyncio.wait_for(idle, 5))[0][1][0][1] == {b"e": b"y"}
    await wait_for(lambda: admin.exists(wakes[0]) == 0, what="close() to expire the wake stream")


async def test_a_slice_without_entries_returns_empty(redis_url, admin):
    async with AsyncClient(redis_url, MODEL, check_model=False) as client:
        mux = client._reader()
        assert await mux.read("t:quiet", b"0-0", 10, 50) == []
        assert not mux.reading("t:quiet")


async def test_a_cancelled_reader_loses_nothing(redis_url, admin):
    """A reader cancelled while the read blocks leaves no registration behind, and the entry written
    afterwards is read by the next read from the same id."""
    async with AsyncClient(redis_url, MODEL, check_model=False) as client:
        mux = client._reader()
        other = asyncio.ensure_future(mux.read("t:other", b"0-0", 10, 20_000))
        gone = asyncio.ensure_future(mux.read("t:gone", b"0-0", 10, 20_000))
        await wait_for(lambda: mux._blocked and mux.reading("t:gone"), what="both registered")
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert not mux.reading("t:gone") and mux.reading("t:other")
        admin.xadd("t:gone", {"e": "z"})
        reply = await asyncio.wait_for(mux.read("t:gone", b"0-0", 10, 20_000), 5)
        assert reply[0][1][0][1] == {b"e": b"z"}
        other.cancel()


async def test_a_dropped_connection_fails_every_waiting_reader(redis_url, admin):
    """CLIENT KILL during the shared read: each reader gets the connection error (the SDK's readers
    then back off and read again from their last id), and the next read works."""
    async with AsyncClient(redis_url, MODEL, check_model=False, client_name="mux-kill") as client:
        mux = client._reader()
        readers = [asyncio.ensure_future(mux.read(f"t:k{i}", b"0-0", 10, 20_000)) for i in range(3)]
        await wait_for(lambda: blocked_of(admin, "mux-kill") == 1, what="the shared read to block")
        assert kill_clients(admin) >= 1
        for r in readers:
            with pytest.raises(redis.exceptions.ConnectionError):
                await asyncio.wait_for(r, 5)
        admin.xadd("t:k0", {"e": "again"})
        reply = await asyncio.wait_for(mux.read("t:k0", b"0-0", 10, 20_000), 5)
        assert reply[0][1][0][1] == {b"e": b"again"}


async def test_a_second_reader_of_one_stream_reads_on_its_own(redis_url, admin):
    """Two handles of one request read it both, from the first event (the second reads directly)."""
    async with FakeWorker(redis_url, token_delay=0.002), AsyncClient(redis_url, MODEL) as client:
        h = await client.submit("x", max_tokens=5)
        twin = client.handle(h.request_id)
        a, b = await asyncio.gather(h.result(timeout=10), twin.result(timeout=10))
        assert a.text == b.text == "w0 w1 w2 w3 w4 "


async def test_a_refused_key_fails_only_its_own_reader(redis_url, admin):
    """A key that is not a stream makes the server refuse the whole shared XREAD: its reader gets the
    WRONGTYPE error, the others their entries, and the next shared reads go on without it."""
    admin.set("t:bad", "not a stream")
    async with AsyncClient(redis_url, MODEL, check_model=False) as client:
        mux = client._reader()
        good = asyncio.ensure_future(mux.read("t:good", b"0-0", 10, 20_000))
        bad = asyncio.ensure_future(mux.read("t:bad", b"0-0", 10, 20_000))
        with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
            await asyncio.wait_for(bad, 5)
        await wait_for(lambda: mux._blocked and not mux.reading("t:bad"), what="the shared read without it")
        admin.xadd("t:good", {"e": "ok"})
        assert (await asyncio.wait_for(good, 5))[0][1][0][1] == {b"e": b"ok"}


async def test_readers_of_a_stopped_shared_read_are_told(redis_url, admin):
    """If the shared read's task stops (cancelled here), its readers get a connection error to retry
    on, rather than waiting forever; the next read starts a new one."""
    async with AsyncClient(redis_url, MODEL, check_model=False, client_name="mux-stop") as client:
        mux = client._reader()
        reader = asyncio.ensure_future(mux.read("t:s", b"0-0", 10, 20_000))
        # blocked on the server: a cancel that lands while redis-py sends the command can be lost
        # in redis-py 8 (the call then returns empty when its BLOCK ends)
        await wait_for(lambda: blocked_of(admin, "mux-stop") == 1, what="the shared read to block")
        mux._task.cancel()
        with pytest.raises(redis.exceptions.ConnectionError):
            await asyncio.wait_for(reader, 5)
        admin.xadd("t:s", {"e": "after"})
        assert (await asyncio.wait_for(mux.read("t:s", b"0-0", 10, 20_000), 5))[0][1][0][1] == {b"e": b"after"}


def test_a_client_read_again_after_its_event_loop_ended_mid_read(redis_url, admin):
    """One client, two `asyncio.run`s; the first ends while the shared read blocks (asyncio.run cancels
    it, and redis-py drops that connection). The second loop's read gets the entry written since."""
    client = AsyncClient(redis_url, MODEL, check_model=False, client_name="mux-loop")

    async def first():
        mux = client._reader()
        t = asyncio.ensure_future(mux.read("t:loop", b"0-0", 10, 20_000))
        await wait_for(lambda: blocked_of(admin, "mux-loop") == 1, what="the shared read to block")
        return t

    async def second():
        return await asyncio.wait_for(client._reader().read("t:loop", b"0-0", 10, 20_000), 5)

    asyncio.run(first())
    admin.xadd("t:loop", {"e": "later"})
    assert asyncio.run(second())[0][1][0][1] == {b"e": b"later"}


async def test_a_reader_with_a_short_slice_is_read_before_it_is_answered_empty(redis_url, admin):
    """A reader joining with a 1 ms slice while the shared read blocks is read at least once: it gets
    the entry already in its stream, as its own XREAD BLOCK 1 would, not an empty slice."""
    entry_id = admin.xadd("t:short", {"e": "there"})
    async with AsyncClient(redis_url, MODEL, check_model=False) as client:
        mux = client._reader()
        idle = asyncio.ensure_future(mux.read("t:idle", b"0-0", 10, 20_000))
        await wait_for(lambda: mux._blocked, what="the shared read to block")
        reply = await asyncio.wait_for(mux.read("t:short", b"0-0", 10, 1), 5)
        assert reply and reply[0][1][0][0] == entry_id
        idle.cancel()


async def test_a_refused_wake_stream_makes_each_reader_read_alone(redis_url, admin):
    """If the server refuses the wake stream (here it is not a stream; an ACL without its key does the
    same), the readers are answered at once and the client's readers read alone from then on."""
    async with AsyncClient(redis_url, MODEL, check_model=False) as client:
        mux = client._reader()
        admin.set(mux._wake_key, "not a stream")
        waiting = asyncio.ensure_future(mux.read("t:w", b"0-0", 10, 20_000))
        assert await asyncio.wait_for(waiting, 5) == []
        assert not mux.usable and client._reader() is None
        admin.xadd("t:w", {"e": "direct"})
        reply = await client._xread({"t:w": b"0-0"}, 10, 1000)  # a plain XREAD now
        assert reply[0][1][0][1] == {b"e": b"direct"}
