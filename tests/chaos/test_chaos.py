"""Faults on purpose; every scenario must end with nothing lost, duplicated or wrong."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
import redis

from producer_sdk.contract import keys
from producer_sdk.protocol import Error, Started
from tests.chaos.harness import Outcome, Traffic, mid_flight, progress, raw_events, score, wait_for, worker
from worker import LLM, SamplingParams
from worker.service.redis_proc import RedisProcess

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

MAX_TOKENS = 120


@pytest.fixture
def aof_redis():
    """A private redis-server with AOF and fsync on every write: a restart loses nothing acked."""
    with RedisProcess(appendonly=True) as server:
        yield server


@pytest.fixture(scope="module")
def reference(llama_dir):
    """An undisturbed offline run: request id -> (prompt, greedy tokens)."""
    rng = random.Random(11)
    prompts = {f"chaos-{i:04d}": [rng.randrange(5, 500) for _ in range(rng.randint(3, 40))] for i in range(60)}
    llm = LLM(model=str(llama_dir), dtype="float32", device="cpu")
    outs = llm.generate(
        list(prompts.values()), SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False
    )
    return {rid: (p, o.outputs[0].token_ids) for (rid, p), o in zip(prompts.items(), outs, strict=True)}


def _pick(reference, n):
    ids = list(reference)[:n]
    return {rid: reference[rid][0] for rid in ids}, {rid: reference[rid][1] for rid in ids}


def _assert_clean(o: Outcome) -> None:
    assert (o.lost, o.duplicated, o.wrong) == (0, 0, 0), o
    assert o.completed + o.errored == o.requests


def test_sigkill_worker_with_50_in_flight(llama_dir, aof_redis, reference):
    prompts, expected = _pick(reference, 50)
    url = aof_redis.url
    first = worker(llama_dir, url, "first").start()
    second = worker(llama_dir, url, "second")
    traffic = Traffic(url, prompts, MAX_TOKENS)
    fault_at = 0.0

    async def during():
        nonlocal fault_at
        await wait_for(lambda: mid_flight(url, prompts, MAX_TOKENS) >= 20, 60, "20 requests mid-generation")
        first.kill()
        fault_at = time.monotonic()
        await asyncio.to_thread(second.start)

    try:
        asyncio.run(traffic.run(during))
    finally:
        second.stop()
        first.stop()
    o = score(Outcome("SIGKILL worker, 50 in flight", len(prompts)), url, list(prompts), expected, traffic.streamed)
    o.recovery_s = round(max(traffic.finished_at.values()) - fault_at, 2)
    _assert_clean(o.record())
    assert o.completed == 50 and o.resumed >= 1


def test_sigkill_between_step_and_final_publish(llama_dir, aof_redis, reference):
    prompts, expected = _pick(reference, 10)
    url = aof_redis.url
    doomed = worker(llama_dir, url, "doomed", env={"PAGEDQ_FAULT_EXIT_BEFORE_FINAL_PUBLISH": "1"}).start()
    rescuer = worker(llama_dir, url, "rescuer")
    traffic = Traffic(url, prompts, MAX_TOKENS)
    fault_at = 0.0

    async def during():
        nonlocal fault_at
        await asyncio.to_thread(doomed.proc.wait, 120)  # it dies right before its first final write
        fault_at = time.monotonic()
        await asyncio.to_thread(rescuer.start)

    try:
        asyncio.run(traffic.run(during))
    finally:
        rescuer.stop()
        doomed.stop()
    o = score(Outcome("SIGKILL before final publish", len(prompts)), url, list(prompts), expected, traffic.streamed)
    o.recovery_s = round(max(traffic.finished_at.values()) - fault_at, 2)
    _assert_clean(o.record())
    assert doomed.proc.returncode == 137 and o.completed == len(prompts) and o.resumed >= 1


def test_redis_restart_mid_run(llama_dir, aof_redis, reference):
    prompts, expected = _pick(reference, 20)
    url = aof_redis.url
    w = worker(llama_dir, url, "steady").start()
    traffic = Traffic(url, prompts, MAX_TOKENS)
    fault_at = 0.0

    async def during():
        nonlocal fault_at
        await wait_for(lambda: mid_flight(url, prompts, MAX_TOKENS) >= 10, 60, "10 requests mid-generation")
        fault_at = time.monotonic()
        await asyncio.to_thread(aof_redis.restart, kill=True)

    try:
        asyncio.run(traffic.run(during))
    finally:
        w.stop()
    o = score(
        Outcome("redis-server SIGKILL + restart (AOF)", len(prompts)), url, list(prompts), expected, traffic.streamed
    )
    o.recovery_s = round(max(traffic.finished_at.values()) - fault_at, 2)
    _assert_clean(o.record())
    assert not traffic.errors, traffic.errors


def test_client_connections_cut_mid_stream(llama_dir, aof_redis, reference):
    prompts, expected = _pick(reference, 20)
    url = aof_redis.url
    w = worker(llama_dir, url, "steady").start()
    traffic = Traffic(url, prompts, MAX_TOKENS)
    fault_at = 0.0

    async def during():
        nonlocal fault_at
        await wait_for(lambda: mid_flight(url, prompts, MAX_TOKENS) >= 10, 60, "10 requests mid-generation")
        fault_at = time.monotonic()
        r = redis.Redis.from_url(url)
        killed = 0
        for _ in range(3):  # several cuts, while tokens flow
            killed += r.client_kill_filter(_type="normal", skipme=True)
            await asyncio.sleep(0.3)
        r.close()
        assert killed > 0

    try:
        asyncio.run(traffic.run(during))
    finally:
        w.stop()
    o = score(
        Outcome("CLIENT KILL readers mid-stream (x3)", len(prompts)), url, list(prompts), expected, traffic.streamed
    )
    o.recovery_s = round(max(traffic.finished_at.values()) - fault_at, 2)
    _assert_clean(o.record())
    assert not traffic.errors, traffic.errors


def test_two_workers_reclaiming_at_once_never_run_a_request_twice(llama_dir, aof_redis, reference):
    prompts, expected = _pick(reference, 30)
    url = aof_redis.url
    first = worker(llama_dir, url, "first").start()
    b, c = worker(llama_dir, url, "b"), worker(llama_dir, url, "c")
    traffic = Traffic(url, prompts, MAX_TOKENS)
    fault_at = 0.0

    async def during():
        nonlocal fault_at
        await wait_for(lambda: mid_flight(url, prompts, MAX_TOKENS) >= 15, 60, "15 requests mid-generation")
        first.kill()
        fault_at = time.monotonic()
        await asyncio.gather(asyncio.to_thread(b.start), asyncio.to_thread(c.start))

    try:
        asyncio.run(traffic.run(during))
    finally:
        b.stop()
        c.stop()
        first.stop()
    o = score(Outcome("two workers reclaim at once", len(prompts)), url, list(prompts), expected, traffic.streamed)
    o.recovery_s = round(max(traffic.finished_at.values()) - fault_at, 2)
    assert o.resumed >= 1
    for rid in prompts:
        starts = [e for e in raw_events(url, rid) if isinstance(e, Started)]
        attempts = [s.attempt for s in starts]
        assert attempts == list(range(1, len(starts) + 1)), (rid, [(s.worker, s.attempt) for s in starts])
        assert len(starts) <= 2, f"{rid} started {len(starts)} times"
    _assert_clean(o.record())


def test_long_request_is_not_stolen_from_a_live_worker(llama_dir, aof_redis, reference):
    url = aof_redis.url
    slow = worker(llama_dir, url, "slow", "--claim-idle-ms", "600").start()
    thief = worker(llama_dir, url, "thief", "--claim-idle-ms", "600").start()
    prompts, _ = _pick(reference, 1)
    rid = next(iter(prompts))
    traffic = Traffic(url, prompts, 4000)  # runs far longer than the 0.6 s idle timeout

    async def during():
        await wait_for(lambda: progress(url, [rid])[0] > 0, 30, "the long request to start")
        await asyncio.sleep(4.0)
        starts = [e for e in raw_events(url, rid) if isinstance(e, Started)]
        assert len(starts) == 1, [(s.worker, s.attempt) for s in starts]
        await wait_for(lambda: progress(url, [rid])[0] >= 200, 60, "more tokens")
        from producer_sdk import AsyncClient

        async with AsyncClient(url) as client:
            await client.cancel(rid)

    try:
        asyncio.run(traffic.run(during))
    finally:
        slow.stop()
        thief.stop()
    events = raw_events(url, rid)
    assert [e.worker for e in events if isinstance(e, Started)] in (["slow"], ["thief"])
    assert [e.seq for e in events] == list(range(len(events)))
    Outcome("long request vs idle timeout", 1, completed=1).record()


def test_poison_request_is_dead_lettered_and_the_worker_keeps_serving(llama_dir, aof_redis, reference):
    prompts, expected = _pick(reference, 12)
    seen = {t for rid in prompts for t in prompts[rid] + expected[rid]}
    poison_token = next(t for t in range(5, 512) if t not in seen)  # only the poison request holds it
    prompts["poison-0001"] = [3, 4, poison_token, 5]
    url = aof_redis.url
    w = worker(
        llama_dir, url, "sturdy", "--max-deliveries", "3", env={"PAGEDQ_FAULT_POISON_TOKEN": str(poison_token)}
    ).start()
    traffic = Traffic(url, prompts, MAX_TOKENS)

    async def during():
        pass

    try:
        asyncio.run(traffic.run(during))
        assert w.proc.poll() is None, "the worker died"
    finally:
        w.stop()
    o = score(
        Outcome("poison request (max_deliveries=3)", len(prompts)), url, list(prompts), expected, traffic.streamed
    )
    events = raw_events(url, "poison-0001")
    assert isinstance(events[-1], Error) and events[-1].code == "engine_error"
    r = redis.Redis.from_url(url)
    dead = [f for _, f in r.xrange(keys.dead_letters("default"))]
    assert [f[b"id"] for f in dead] == [b"poison-0001"] and dead[0][b"code"] == b"engine_error"
    assert o.errored == 1 and o.completed == len(prompts) - 1
    _assert_clean(o.record())


def test_sigterm_hands_unfinished_work_over(llama_dir, aof_redis, reference):
    prompts, expected = _pick(reference, 20)
    url = aof_redis.url
    leaving = worker(llama_dir, url, "leaving", "--drain-timeout", "0.5").start()
    staying = worker(llama_dir, url, "staying").start()
    traffic = Traffic(url, prompts, MAX_TOKENS * 3)
    expected = {}  # longer than the reference run: checked for exactness below instead
    fault_at = 0.0

    async def during():
        nonlocal fault_at
        await wait_for(lambda: mid_flight(url, prompts, MAX_TOKENS * 3) >= 10, 60, "10 requests mid-generation")
        fault_at = time.monotonic()
        leaving.signal(15)

    try:
        asyncio.run(traffic.run(during))
        assert leaving.wait(60) == 0
    finally:
        leaving.stop()
        staying.stop()
    o = score(
        Outcome("SIGTERM with short drain: handover", len(prompts)), url, list(prompts), expected, traffic.streamed
    )
    o.recovery_s = round(max(traffic.finished_at.values()) - fault_at, 2)
    llm = LLM(model=str(llama_dir), dtype="float32", device="cpu")
    outs = llm.generate(
        list(prompts.values()),
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS * 3, ignore_eos=True),
        use_tqdm=False,
    )
    o.wrong = sum(traffic.streamed[rid] != out.outputs[0].token_ids for rid, out in zip(prompts, outs, strict=True))
    _assert_clean(o.record())
    assert o.completed == len(prompts) and o.resumed >= 1
