"""AsyncClient against a real redis-server, with a test double of the worker (sdk_fake_worker)."""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
import pytest
from sdk_fake_worker import FakeWorker, wait_for

from producer_sdk import (
    AsyncClient,
    Cancelled,
    Client,
    DeadlineExceeded,
    ModelNotFound,
    ProtocolError,
    QueueFull,
    RequestFailed,
    RequestLost,
    RequestTimeout,
    StreamDiverged,
    ValidationError,
)
from producer_sdk.contract import keys
from producer_sdk.contract.connection import connect
from producer_sdk.protocol import (
    Finished,
    Started,
    Tokens,
    encode_event,
)
from producer_sdk.request_codec import decode_request

MODEL = "default"


@pytest.fixture
async def client(redis_url):
    async with AsyncClient(redis_url, MODEL, block_ms=200) as c:
        yield c


@pytest.fixture
def admin(redis_url):
    r = connect(redis_url, asyncio=False, socket_timeout=10)
    yield r
    r.close()


def lane_len(admin, lane="normal") -> int:
    return admin.xlen(keys.lane_stream(MODEL, lane))


async def test_submit_stream_result(redis_url, client, admin):
    async with FakeWorker(redis_url) as worker:
        handle = await client.submit("Hello", max_tokens=4, metadata={"tenant": "acme"})
        assert not handle.duplicate and handle.entry_id and handle.finish_reason is None
        chunks = [c async for c in handle.stream(timeout=5)]
        assert [c.text for c in chunks] == ["w0 ", "w1 ", "w2 ", "w3 "]
        assert [c.token_ids for c in chunks] == [[0], [1], [2], [3]]
        assert [c.seq for c in chunks] == [1, 2, 3, 4]  # seq 0 is Started
        assert handle.finish_reason == "length" and handle.usage.completion_tokens == 4
        assert handle.timings.ttft_ms == 1.0

        done = await handle.result()
        assert done.text == "w0 w1 w2 w3 " and done.token_ids == [0, 1, 2, 3]
        assert done.finish_reason == "length" and done.worker == "fake-1"
        assert done.request_id == handle.request_id and len(done.choices) == 1
        assert worker.requests[0].metadata == {"tenant": "acme"}
        assert worker.requests[0].sampling.max_tokens == 4
        await wait_for(lambda: lane_len(admin) == 0, 10, "the ack")  # XDELed after the final event


async def test_generate_and_stream_shortcuts(redis_url, client):
    async with FakeWorker(redis_url):
        done = await client.generate("Hi", max_tokens=2, timeout=5)
        assert done.text == "w0 w1 "
        texts = [c.text async for c in client.stream("Hi", max_tokens=3, timeout=5)]
        assert texts == ["w0 ", "w1 ", "w2 "]


async def test_n_samples_and_logprobs(redis_url, client):
    async with FakeWorker(redis_url):
        done = await client.generate(prompt_token_ids=[1, 2, 3], n=2, max_tokens=2, logprobs=1, timeout=5)
    assert [c.token_ids for c in done.choices] == [[0, 1], [1000, 1001]]
    assert [c.finish_reason for c in done.choices] == ["length", "length"]
    assert done.choices[1].logprobs == [-0.5, -0.5]
    assert done.choices[1].top_logprobs[0] == [(1000, -0.5), (7, -3.0)]
    assert done.logprobs == done.choices[0].logprobs


async def test_two_readers_and_reattach(redis_url, client):
    async with FakeWorker(redis_url):
        handle = await client.submit("x", max_tokens=3)
        async with AsyncClient(redis_url, MODEL) as other:
            twin = other.handle(handle.request_id)
            a, b = await asyncio.gather(handle.result(timeout=5), twin.result(timeout=5))
    assert a == b
    again = [c.text async for c in handle.stream(timeout=5)]  # a second stream reads from the start
    assert "".join(again) == a.text


async def test_late_reader_sees_everything(redis_url, client):
    async with FakeWorker(redis_url) as worker:
        handle = await client.submit("x", max_tokens=5)
        await wait_for(lambda: handle.request_id in worker.finished, what="the request to finish")
    done = await handle.result(timeout=5)  # the worker is gone; the events are still there
    assert done.token_ids == [0, 1, 2, 3, 4]


def _write_events(admin, rid: str, events) -> None:
    for ev in events:
        admin.xadd(keys.response_stream(rid), {"e": encode_event(ev)})


async def test_duplicate_events_are_dropped(client, admin):
    rid = "dup_events_1"
    admin.set(keys.submitted_marker("default", rid), 1)
    _write_events(
        admin,
        rid,
        [
            Started(seq=0, worker="w"),
            Tokens(seq=1, token_ids=[1], text="a"),
            Tokens(seq=1, token_ids=[1], text="a"),  # a duplicate from an unfenced writer
            Started(seq=2, worker="w2", attempt=2),  # a second attempt resumes where the first ended
            Tokens(seq=3, attempt=2, token_ids=[2], text="b"),
            Finished(seq=4, attempt=2, finish_reason="stop", finish_reasons=["stop"]),
        ],
    )
    chunks = [c async for c in client.handle(rid).stream(timeout=5)]
    assert [c.text for c in chunks] == ["a", "b"]


async def test_an_attempt_restarting_before_what_was_read_is_a_divergence(client, admin):
    """Redis lost the tail of the stream in a failover and a new attempt restarted from what was left:
    the reader must not splice the new attempt's text onto the old one."""
    rid = "diverged_events_1"
    admin.set(keys.submitted_marker("default", rid), 1)
    _write_events(
        admin,
        rid,
        [
            Started(seq=0, worker="w"),
            Tokens(seq=1, token_ids=[1], text="a"),
            Tokens(seq=2, token_ids=[2], text="b"),
            Started(seq=1, worker="w2", attempt=2),  # the new primary only had seq 0
            Tokens(seq=2, attempt=2, token_ids=[9], text="z"),
        ],
    )
    seen = []
    with pytest.raises(StreamDiverged, match="attempt 2 restarted the stream at seq 1"):
        async for c in client.handle(rid).stream(timeout=5):
            seen.append(c.text)
    assert seen == ["a", "b"]


async def test_gap_in_events_is_a_protocol_error(client, admin):
    rid = "gap_events_1"
    _write_events(
        admin, rid, [Started(seq=0, worker="w"), Tokens(seq=1, token_ids=[1], text="a"), Tokens(seq=3, token_ids=[3])]
    )
    seen = []
    with pytest.raises(ProtocolError, match=r"events 2\.\.2 are missing"):
        async for c in client.handle(rid).stream(timeout=5):
            seen.append(c.text)
    assert seen == ["a"]  # what came before the gap was delivered


async def test_stale_final_event_is_a_protocol_error_not_a_hang(client, admin):
    rid = "stale_final_1"
    _write_events(
        admin,
        rid,
        [Started(seq=0, worker="w"), Tokens(seq=1, token_ids=[1]), Finished(seq=1, finish_reason="stop")],
    )
    with pytest.raises(ProtocolError, match="final event with seq 1"):
        await client.handle(rid).result(timeout=5)


async def test_undecodable_event_is_a_protocol_error(client, admin):
    rid = "bad_event_1"
    admin.xadd(keys.response_stream(rid), {"e": b"\xc1"})
    with pytest.raises(ProtocolError, match="msgpack"):
        await client.handle(rid).result(timeout=5)


async def test_error_event_raises_request_failed(redis_url, client):
    async with FakeWorker(redis_url):
        handle = await client.submit("fail")
        with pytest.raises(RequestFailed) as info:
            await handle.result(timeout=5)
    assert info.value.code == "engine_error" and "boom" in str(info.value)
    with pytest.raises(RequestFailed):  # remembered
        await handle.result()


async def test_bad_payload_is_answered_and_dead_lettered(redis_url, client, admin):
    rid = "garbage_payload_1"
    admin.xadd(keys.lane_stream(MODEL, "normal"), {"id": rid, "d": b"\xc1garbage"})
    async with FakeWorker(redis_url):
        with pytest.raises(RequestFailed) as info:
            await client.handle(rid).result(timeout=5)
        assert info.value.code == "malformed"
        stats = await client.queue_stats()
    assert stats.dead_letters == 1
    ((_, fields),) = admin.xrange(keys.dead_letters(MODEL))
    assert fields[b"id"] == rid.encode() and fields[b"code"] == b"malformed"


async def test_idempotent_resubmit(redis_url, client, admin):
    rid = "same_request_1"
    first = await client.submit("x", request_id=rid, max_tokens=2)
    second = await client.submit("x", request_id=rid, max_tokens=2)
    assert not first.duplicate and second.duplicate and second.entry_id is None
    assert lane_len(admin) == 1
    async with FakeWorker(redis_url) as worker:
        a = await first.result(timeout=5)
        b = await second.result(timeout=5)
    assert a == b and len(worker.requests) == 1
    third = await client.submit("x", request_id=rid, max_tokens=2)  # even after it finished
    assert third.duplicate and (await third.result(timeout=5)) == a


async def test_queue_full_with_client_limit(redis_url):
    async with AsyncClient(redis_url, MODEL, max_queue_len=2) as c:
        await c.submit("a")
        await c.submit("b")
        with pytest.raises(QueueFull) as info:
            await c.submit("c")
        assert (info.value.lane, info.value.length, info.value.limit) == ("normal", 2, 2)
        assert "queue full" in str(info.value)
        with pytest.raises(QueueFull) as info:
            await c.submit("d", priority=1)  # the limit covers the model's lanes together
        assert (info.value.lane, info.value.length) == ("high", 2)


async def test_queue_limit_is_atomic_under_concurrent_submits(redis_url, admin):
    clients = [AsyncClient(redis_url, MODEL, max_queue_len=5) for _ in range(4)]
    try:
        results = await asyncio.gather(*(c.submit("x") for c in clients for _ in range(10)), return_exceptions=True)
    finally:
        for c in clients:
            await c.close()
    assert sum(isinstance(r, QueueFull) for r in results) == 35
    assert lane_len(admin) == 5


async def test_queue_full_with_the_workers_limit(client, admin):
    admin.hset(keys.config(MODEL), "max_queue_len", 1)
    await client.submit("a")
    with pytest.raises(QueueFull) as info:
        await client.submit("b")
    assert info.value.limit == 1
    assert (await client.queue_stats()).max_queue_len == 1


async def test_submit_many_pipelined(redis_url, client, admin):
    handles = await client.submit_many(["a", "b", {"prompt": "c", "max_tokens": 1, "priority": -1}], max_tokens=2)
    assert lane_len(admin) == 2 and lane_len(admin, "low") == 1
    async with FakeWorker(redis_url):
        results = [await h.result(timeout=5) for h in handles]
        await wait_for(lambda: lane_len(admin) + lane_len(admin, "low") == 0, 10, "the acks")
    assert [len(r.token_ids) for r in results] == [2, 2, 1]

    admin.hset(keys.config(MODEL), "max_queue_len", 2)
    await client.submit("fill")
    with pytest.raises(QueueFull) as info:
        await client.submit_many(["x", "y", {"prompt": "z", "priority": 5}])
    assert [h is not None for h in info.value.handles] == [True, False, False]

    with pytest.raises(ValidationError, match="item 1"):
        await client.submit_many(["ok", {"prompt": "bad", "top_p": 7}], priority=3)
    assert lane_len(admin, "high") == 0  # nothing of the invalid batch was sent


async def test_cancel_running(redis_url, client, admin):
    async with FakeWorker(redis_url, token_delay=0.005) as worker:
        handle = await client.submit("forever")
        seen = 0
        with pytest.raises(Cancelled) as info:
            async for _ in handle.stream(timeout=10):
                seen += 1
                if seen == 1:
                    await handle.cancel()
        await wait_for(lambda: worker.control, what="the cancel message")
    assert worker.control[0].type == "cancel" and worker.control[0].request_id == handle.request_id
    flag = keys.cancel_flag(handle.request_id)
    assert admin.get(flag) == b"1" and 0 < admin.ttl(flag) <= 86400
    partial = info.value.completion
    assert partial.finish_reason == "abort" and len(partial.token_ids) == seen
    assert handle.finish_reason == "abort"
    done = await handle.result(partial_ok=True)
    assert done.finish_reason == "abort"
    with pytest.raises(Cancelled):
        await handle.result()


async def test_leaving_client_stream_early_cancels(redis_url, client):
    async with FakeWorker(redis_url, token_delay=0.005) as worker:
        async with contextlib.aclosing(client.stream("forever", timeout=10)) as chunks:
            async for _ in chunks:
                break
        await wait_for(lambda: "abort" in worker.finished.values(), what="the abort")


async def test_cancel_while_queued(redis_url, client):
    handle = await client.submit("x")
    await client.cancel(handle.request_id)
    async with FakeWorker(redis_url):
        with pytest.raises(Cancelled):
            await handle.result(timeout=5)
    assert handle.finish_reason == "abort"


async def test_timeout_keeps_the_request_unless_asked(client, admin):
    handle = await client.submit("x")  # no worker: nothing will come
    with pytest.raises(RequestTimeout) as info:
        await handle.result(timeout=0.2)
    assert isinstance(info.value, TimeoutError) and not info.value.cancelled
    assert not admin.exists(keys.cancel_flag(handle.request_id))
    with pytest.raises(RequestTimeout) as info:
        await client.generate("y", timeout=0.1, cancel_on_timeout=True)
    assert info.value.cancelled and admin.exists(keys.cancel_flag(info.value.request_id))


async def test_deadline(redis_url, client):
    async with FakeWorker(redis_url, token_delay=0.005):
        with pytest.raises(DeadlineExceeded) as info:
            await client.generate("forever", deadline=1.0, timeout=5)
        assert info.value.completion.finish_reason == "deadline"
        assert info.value.completion.worker == "fake-1"
        past = await client.submit("x", deadline=-1)  # already past: never started
        done = await past.result(timeout=5, partial_ok=True)
    assert done.finish_reason == "deadline" and done.worker is None and done.token_ids == []


async def test_chat_messages_payload(redis_url, client, admin):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 👋"}]
    handle = await client.submit(messages=messages, temperature=0.0, stop=["\n"], seed=7)
    ((_, fields),) = admin.xrange(keys.lane_stream(MODEL))
    assert fields[b"id"] == handle.request_id.encode()
    req = decode_request(fields[b"d"])
    assert [(m.role, m.content) for m in req.messages] == [(m["role"], m["content"]) for m in messages]
    assert req.prompt is None and req.add_generation_prompt
    assert (req.sampling.temperature, req.sampling.stop, req.sampling.seed) == (0.0, ["\n"], 7)
    assert msgspec.msgpack.decode(fields[b"d"])["v"] == 1
    async with FakeWorker(redis_url):
        assert (await handle.result(timeout=5)).finish_reason == "length"


async def test_priority_lanes(redis_url, client, admin):
    low = await client.submit("l", priority=-5, max_tokens=1)
    normal = await client.submit("n", max_tokens=1)
    high = await client.submit("h", priority=5, max_tokens=1)
    stats = await client.queue_stats()
    assert stats.lanes == {"high": 1, "normal": 1, "low": 1} and stats.queued == 3
    async with FakeWorker(redis_url) as worker:
        for h in (low, normal, high):
            await h.result(timeout=5)
    assert [r.request_id for r in worker.requests] == [high.request_id, normal.request_id, low.request_id]
    assert worker.requests[0].priority == 5


async def test_queue_stats_workers(client, admin):
    from producer_sdk.protocol import WorkerState, now_ms

    live = WorkerState(worker="gpu-a", host="h1", pid=42, model=MODEL, running=3, waiting=1, kv_usage=0.25)
    admin.set(keys.worker_state(MODEL, "gpu-a"), msgspec.json.encode(live), px=3000)
    admin.zadd(keys.heartbeats(MODEL), {"gpu-a": now_ms(), "gpu-dead": now_ms() - 60_000})
    admin.xadd(keys.dead_letters(MODEL), {"id": "", "reason": "bad", "code": "malformed"})
    stats = await client.queue_stats()
    assert stats.workers == [live] and stats.dead_letters == 1
    assert admin.zrange(keys.heartbeats(MODEL), 0, -1) == [b"gpu-a"]  # the dead one was pruned


async def test_validation_happens_before_sending(client, admin):
    with pytest.raises(ValidationError, match=r"sampling\.temperature"):
        await client.submit("x", temperature=-1)
    with pytest.raises(ValidationError, match="exactly one"):
        await client.submit("x", messages=[{"role": "user", "content": "y"}])
    with pytest.raises(TypeError, match="valid: n, max_tokens"):
        await client.submit("x", max_new_tokens=5)
    assert admin.keys(keys.model_prefix("default") + "*") == [] and admin.keys("pagedq:resp:*") == []


async def test_an_unknown_model_fails_at_once_naming_the_served_ones(redis_url, admin):
    async with AsyncClient(redis_url, "defualt") as typo:
        with pytest.raises(ModelNotFound) as info:
            await typo.submit("x")
        assert info.value.served == ["default"] and "'defualt'" in str(info.value)
        assert [m.name for m in await typo.served_models()] == ["default"]
    assert admin.keys(keys.model_prefix("defualt") + "*") == []  # nothing was enqueued
    with Client(redis_url, "defualt") as typo_sync, pytest.raises(ModelNotFound):
        typo_sync.submit_many(["x", "y"])
    async with AsyncClient(redis_url, "not-yet", check_model=False) as early:
        assert (await early.submit("queued before any worker")).entry_id  # the opt-out enqueues


async def test_unknown_request_is_reported_lost(client):
    with pytest.raises(RequestLost, match="no such request"):
        await client.handle("never_submitted").result(timeout=5)


async def test_existing_redis_instance(redis_url):
    r = connect(redis_url, asyncio=True, socket_timeout=10)
    async with FakeWorker(redis_url), AsyncClient(r, MODEL) as c:
        assert (await c.generate("x", max_tokens=1, timeout=5)).token_ids == [0]
    assert await r.ping()  # not closed: the caller owns it
    await r.aclose()
    with pytest.raises(ValueError, match="decode_responses"):
        AsyncClient(connect(redis_url, asyncio=True, socket_timeout=10, decode_responses=True))
