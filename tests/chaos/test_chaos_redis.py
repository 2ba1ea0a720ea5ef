"""Redis misbehaving in every way a worker meets in production; each fault forced with a hook, each
run scored against an undisturbed offline run: 0 lost, 0 duplicated, 0 wrong, nothing left hanging."""

from __future__ import annotations

import asyncio
import hashlib
import random
import time

import msgspec
import pytest
import redis

from producer_sdk import AsyncClient
from producer_sdk.contract import keys, scripts
from producer_sdk.protocol import Error, Started, Tokens, encode_event
from tests.chaos.harness import Outcome, Traffic, mid_flight, progress, raw_events, score, wait_for, worker
from tests.chaos.proxy import ReplyDroppingProxy
from tests.service.worker_proc import wait_acked
from worker import LLM, SamplingParams
from worker.service.redis_proc import RedisProcess

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

MAX_TOKENS = 60
PUBLISH_SHA = hashlib.sha1(scripts.PUBLISH.encode()).hexdigest()
ACK_SHA = hashlib.sha1(scripts.ACK.encode()).hexdigest()


@pytest.fixture
def aof_redis():
    with RedisProcess(appendonly=True) as server:
        yield server


@pytest.fixture(scope="module")
def reference(llama_dir):
    rng = random.Random(23)
    prompts = {f"fault-{i:04d}": [rng.randrange(5, 500) for _ in range(rng.randint(3, 40))] for i in range(40)}
    llm = LLM(model=str(llama_dir), dtype="float32", device="cpu")
    outs = llm.generate(
        list(prompts.values()), SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False
    )
    return {rid: (p, o.outputs[0].token_ids) for (rid, p), o in zip(prompts.items(), outs, strict=True)}


def _pick(reference, n, skip=0):
    ids = list(reference)[skip : skip + n]
    return {rid: reference[rid][0] for rid in ids}, {rid: reference[rid][1] for rid in ids}


def _clean(o: Outcome) -> None:
    assert (o.lost, o.duplicated, o.wrong) == (0, 0, 0), o
    assert o.completed + o.errored == o.requests, o


def _run(fault: str, url: str, prompts, expected, during, *workers) -> tuple[Outcome, Traffic]:
    traffic = Traffic(url, prompts, MAX_TOKENS)
    fault_at = [time.monotonic()]

    async def wrapped():
        await during()
        fault_at[0] = time.monotonic()

    try:
        asyncio.run(traffic.run(wrapped))
    finally:
        for w in workers:
            w.stop()
    o = score(Outcome(fault, len(prompts)), url, list(prompts), expected, traffic.streamed)
    o.recovery_s = round(max(0.0, max(traffic.finished_at.values()) - fault_at[0]), 2)
    return o, traffic


@pytest.mark.parametrize("restart", [False, True], ids=["reply-lost", "reply-lost+restart"])
def test_lost_publish_reply_writes_nothing_twice(llama_dir, aof_redis, reference, restart):
    """Redis ran the publish script, the reply never came back, the worker sent the batch again."""
    prompts, expected = _pick(reference, 20)
    proxy = ReplyDroppingProxy(aof_redis.port)
    w = worker(llama_dir, proxy.url, "behind-proxy").start()

    async def during():
        await wait_for(lambda: mid_flight(aof_redis.url, prompts, MAX_TOKENS) >= 10, 60, "10 requests mid-generation")
        for _ in range(3):  # three lost replies, a few steps apart
            proxy.drop_next_reply_to(PUBLISH_SHA)
            await asyncio.to_thread(proxy.fired.wait, 30)
            if restart:
                await asyncio.to_thread(aof_redis.restart, kill=True)
            await asyncio.sleep(0.2)

    name = "lost publish reply + redis restart" if restart else "lost publish reply (x3)"
    try:
        o, traffic = _run(name, aof_redis.url, prompts, expected, during, w)
    finally:
        proxy.close()
    assert proxy.dropped >= 3
    _clean(o.record())
    assert o.completed == len(prompts) and not traffic.errors, traffic.errors


def test_maxmemory_reached_then_freed(llama_dir, aof_redis, reference):
    prompts, expected = _pick(reference, 20)
    w = worker(llama_dir, aof_redis.url, "oom").start()
    admin = redis.Redis.from_url(aof_redis.url)

    async def during():
        await wait_for(lambda: mid_flight(aof_redis.url, prompts, MAX_TOKENS) >= 10, 60, "10 requests mid-generation")
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", 1)  # every write is refused with OOM from now on
        before = progress(aof_redis.url, list(prompts))
        await asyncio.sleep(1.5)
        assert progress(aof_redis.url, list(prompts)) == before  # nothing was written meanwhile
        admin.config_set("maxmemory", 0)

    o, traffic = _run("maxmemory reached, then freed", aof_redis.url, prompts, expected, during, w)
    assert "OutOfMemoryError" in w.log_path.read_text()  # the fault really struck
    _clean(o.record())
    assert o.completed == len(prompts) and not traffic.errors, traffic.errors


def test_a_wrongtype_key_ends_only_its_own_request(llama_dir, aof_redis, reference):
    prompts, expected = _pick(reference, 12)
    victim = next(iter(prompts))
    admin = redis.Redis.from_url(aof_redis.url)
    admin.set(keys.response_stream(victim), "not a stream")  # planted where the response stream goes
    w = worker(llama_dir, aof_redis.url, "sturdy").start()

    async def during():
        pass

    traffic = Traffic(aof_redis.url, prompts, MAX_TOKENS)
    try:
        asyncio.run(traffic.run(during))
        assert w.proc.poll() is None, "the worker died"
    finally:
        w.stop()
    others = [rid for rid in prompts if rid != victim]
    o = score(
        Outcome("WRONGTYPE key at one response stream", len(others)), aof_redis.url, others, expected, traffic.streamed
    )
    dead = [f for _, f in admin.xrange(keys.dead_letters("default"))]
    assert [(f[b"id"], f[b"code"]) for f in dead] == [(victim.encode(), b"stream_unwritable")]
    assert "WRONGTYPE" in traffic.errors[victim]  # its reader got the server's own error at once
    wait_acked(aof_redis.url)
    o.errored, o.requests = 1, len(prompts)
    _clean(o.record())
    assert o.completed == len(others)


def test_readonly_after_failover_then_promoted_back(llama_dir, reference, tmp_path):
    """The worker's Redis becomes a replica (writes answer READONLY) for a while, then primary again."""
    prompts, expected = _pick(reference, 20)
    with RedisProcess(appendonly=True) as a:
        b = RedisProcess(extra_args=["--replicaof", "127.0.0.1", str(a.port)]).start()
        ra, rb = redis.Redis.from_url(a.url), redis.Redis.from_url(b.url)
        try:
            wait_link = lambda: rb.info("replication").get("master_link_status") == "up"
            deadline = time.monotonic() + 10
            while not wait_link() and time.monotonic() < deadline:
                time.sleep(0.05)
            w = worker(llama_dir, a.url, "failover").start()

            async def during():
                await wait_for(lambda: mid_flight(a.url, prompts, MAX_TOKENS) >= 10, 60, "10 requests mid-generation")
                ra.execute_command("CLIENT", "PAUSE", 5000, "WRITE")  # let the replica catch up, lose nothing
                while ra.info("replication")["master_repl_offset"] != rb.info("replication")["slave_repl_offset"]:
                    await asyncio.sleep(0.01)
                rb.replicaof("NO", "ONE")
                ra.replicaof("127.0.0.1", b.port)  # a is a replica now: the worker's writes get READONLY
                ra.execute_command("CLIENT", "UNPAUSE")
                await asyncio.sleep(1.5)
                ra.replicaof("NO", "ONE")  # promoted back
                rb.replicaof("127.0.0.1", a.port)

            o, traffic = _run("READONLY (failover), promoted back", a.url, prompts, expected, during, w)
            assert "ReadOnlyError" in w.log_path.read_text()  # the fault really struck
            _clean(o.record())
            assert o.completed == len(prompts) and not traffic.errors, traffic.errors
        finally:
            ra.close()
            rb.close()
            b.cleanup()


def test_malformed_and_unknown_events_in_reclaimed_streams(llama_dir, aof_redis, reference):
    """A dead worker's requests are reclaimed; one stream holds an event that does not decode, one an
    event of a type from the future. Only the first ends (with a typed error); all others resume."""
    prompts, expected = _pick(reference, 12)
    ids = list(prompts)
    corrupt, future = ids[0], ids[1]
    url = aof_redis.url
    first = worker(llama_dir, url, "first").start()
    second = worker(llama_dir, url, "second")
    admin = redis.Redis.from_url(url)

    async def during():
        await wait_for(lambda: all(0 < n < MAX_TOKENS for n in progress(url, ids[:2])), 60, "both mid-generation")
        first.kill()
        seq = len(raw_events(url, future))
        unknown = msgspec.msgpack.encode({"type": "x-future", "seq": seq, "detail": [1, 2]})
        admin.xadd(keys.response_stream(future), {keys.EVENT_FIELD: unknown, keys.EVENT_SEQ_FIELD: seq})
        seq = len(raw_events(url, corrupt))
        admin.xadd(keys.response_stream(corrupt), {keys.EVENT_FIELD: b"\xc1 not msgpack", keys.EVENT_SEQ_FIELD: seq})
        await asyncio.to_thread(second.start)

    traffic = Traffic(url, prompts, MAX_TOKENS)
    try:
        asyncio.run(traffic.run(during))
    finally:
        second.stop()
        first.stop()
    others = ids[1:]
    o = score(
        Outcome("malformed/unknown event in reclaimed stream", len(others)), url, others, expected, traffic.streamed
    )
    assert "ProtocolError" in traffic.errors[corrupt] or "MalformedPayload" in traffic.errors[corrupt]
    dead = {f[b"id"]: f[b"code"] for _, f in admin.xrange(keys.dead_letters("default"))}
    assert dead == {corrupt.encode(): b"stream_corrupt"}
    assert traffic.streamed[future] == expected[future]  # the future event was skipped, not fatal
    o.errored, o.requests = o.errored + 1, len(prompts)
    _clean(o.record())
    assert o.completed == len(others) and o.resumed >= 1


def test_long_stream_cancelled_after_reclaim_keeps_its_head(llama_dir, aof_redis):
    """A request a dead worker streamed 3,000 events for is cancelled; the worker that reclaims it
    answers at once, and the stream still holds every event: its reader sees no gap."""
    url = aof_redis.url
    admin = redis.Redis.from_url(url)
    rid = "long-cancelled-0001"
    admin.xgroup_create(keys.lane_stream("default"), keys.group("default"), id="0", mkstream=True)

    async def submit():
        async with AsyncClient(url, check_model=False) as client:  # no worker has run yet
            await client.submit(prompt_token_ids=[5, 6, 7], request_id=rid, max_tokens=10_000, ignore_eos=True)

    asyncio.run(submit())
    admin.xreadgroup(keys.group("default"), "dead-worker", {keys.lane_stream("default"): ">"}, count=1)
    events = [Started(seq=0, worker="dead-worker")] + [Tokens(seq=i, token_ids=[7], text="x") for i in range(1, 3000)]
    pipe = admin.pipeline()
    for ev in events:
        pipe.xadd(keys.response_stream(rid), {keys.EVENT_FIELD: encode_event(ev), keys.EVENT_SEQ_FIELD: ev.seq})
    pipe.execute()
    admin.set(keys.cancel_flag(rid), 1)
    w = worker(llama_dir, url, "rescuer", "--claim-idle-ms", "500").start()
    t0 = time.monotonic()
    try:

        async def read():
            async with AsyncClient(url) as client:
                return [c async for c in client.handle(rid).stream(timeout=60, partial_ok=True)]

        chunks = asyncio.run(read())
    finally:
        w.stop()
    stored = raw_events(url, rid)
    assert len(chunks) == 2999 and len(stored) == 3001
    assert [e.seq for e in stored] == list(range(3001)) and stored[-1].finish_reason == "abort"
    Outcome(
        "3,000-event stream cancelled after reclaim", 1, completed=1, recovery_s=round(time.monotonic() - t0, 2)
    ).record()


def test_concurrent_admissions_share_one_tokenizer(llama_dir, aof_redis):
    """Many text and chat requests at once: tokenization (one dedicated thread) never fails or mixes them up."""
    rng = random.Random(5)
    words = ["alpha", "beta", "gamma", "delta", "pagedq", "redis", "stream", "token", "émoji", "日本"]
    texts = {f"tok-{i:04d}": " ".join(rng.choice(words) for _ in range(rng.randint(5, 300))) for i in range(64)}
    llm = LLM(model=str(llama_dir), dtype="float32", device="cpu")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    want = {
        rid: o.outputs[0].token_ids for rid, o in zip(texts, llm.generate(list(texts.values()), params, use_tqdm=False))
    }
    w = worker(llama_dir, aof_redis.url, "tokenizer").start()
    t0 = time.monotonic()
    try:

        async def run():
            async with AsyncClient(aof_redis.url) as client:
                handles = await client.submit_many(
                    [{"prompt": text, "request_id": rid} for rid, text in texts.items()],
                    max_tokens=8,
                    temperature=0,
                    ignore_eos=True,
                )
                return await asyncio.gather(*(h.result(timeout=120) for h in handles))

        results = asyncio.run(run())
    finally:
        w.stop()
    wrong = sum(r.token_ids != want[r.request_id] for r in results)
    o = Outcome("concurrent admissions, one tokenizer", len(texts), completed=len(results), wrong=wrong)
    o.recovery_s = round(time.monotonic() - t0, 2)
    _clean(o.record())


def test_a_dead_background_task_stops_the_worker_and_its_work_moves_on(llama_dir, aof_redis, reference, tmp_path):
    """A duty dies (here the heartbeat, by a fault hook): the worker stops pulling, hands its requests
    over and exits non-zero; another worker finishes them."""
    prompts, expected = _pick(reference, 16)
    url = aof_redis.url
    crash = tmp_path / "crash-now"
    env = {"PAGEDQ_FAULT_STEP_DELAY_S": "0.1", "PAGEDQ_FAULT_HEARTBEAT_CRASH_FILE": str(crash)}
    doomed = worker(llama_dir, url, "doomed", env=env).start()
    rescuer = worker(llama_dir, url, "rescuer")

    async def during():
        await wait_for(lambda: mid_flight(url, prompts, MAX_TOKENS) >= 8, 60, "8 requests mid-generation")
        crash.touch()
        assert await asyncio.to_thread(doomed.wait, 60) == 1
        await asyncio.to_thread(rescuer.start)

    o, traffic = _run("background task dies: exit 1, handover", url, prompts, expected, during, rescuer, doomed)
    assert "background task died" in doomed.log() and "handing over unfinished requests" in doomed.log()
    _clean(o.record())
    assert o.completed == len(prompts) and o.resumed >= 1 and not traffic.errors
    errors = [e for rid in prompts for e in raw_events(url, rid) if isinstance(e, Error)]
    assert errors == []


def test_lost_ack_reply_counts_nothing_twice(llama_dir, aof_redis, reference):
    """Redis ran the ack step (the entry deleted, its tokens counted), the reply never came back, the
    worker sent it again: nothing is deleted or counted a second time."""
    prompts, expected = _pick(reference, 20)
    admin = redis.Redis.from_url(aof_redis.url)
    proxy = ReplyDroppingProxy(aof_redis.port)
    w = worker(llama_dir, proxy.url, "behind-proxy").start()

    def window() -> int:
        seconds, _ = admin.time()
        return seconds // 60

    seconds, _ = admin.time()
    if seconds % 60 > 40:  # the token window must not turn over during the run (about 6 s; checked below)
        time.sleep(60 - seconds % 60 + 0.1)
    first = window()

    async def during():
        await wait_for(lambda: mid_flight(aof_redis.url, prompts, MAX_TOKENS) >= 10, 60, "10 requests mid-generation")
        for _ in range(3):  # three lost replies
            proxy.drop_next_reply_to(ACK_SHA)
            await asyncio.to_thread(proxy.fired.wait, 30)

    try:
        o, traffic = _run("lost ack reply (x3)", aof_redis.url, prompts, expected, during, w)
        wait_acked(aof_redis.url)
    finally:
        proxy.close()
    assert proxy.dropped >= 3
    _clean(o.record())
    assert o.completed == len(prompts) and not traffic.errors, traffic.errors
    assert window() == first, "the run crossed a minute: its tokens are in two windows"
    counted = int(admin.hget(keys.tenant_tokens("default", "default"), "n"))
    assert counted == sum(len(p) + MAX_TOKENS for p in prompts.values())  # each request once
    assert not admin.hget(keys.tenant_queued("default"), "default")  # every entry counted down once
    admin.close()
