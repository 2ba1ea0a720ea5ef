"""The worker service against a real redis-server and real worker processes."""

from __future__ import annotations

import asyncio
import random

import msgspec
import pytest

from producer_sdk import AsyncClient, Client
from producer_sdk.contract import keys
from producer_sdk.contract.connection import connect
from producer_sdk.errors import Cancelled, RequestFailed
from producer_sdk.protocol import Error, Finished, Started, Tokens
from tests.service.worker_proc import WorkerProc, response_events, wait_acked, wait_until
from worker import LLM, SamplingParams


def check_stream(events) -> None:
    """Contiguous seq from 0, exactly one terminal event, at the end."""
    assert [e.seq for e in events] == list(range(len(events)))
    terminal = [i for i, e in enumerate(events) if isinstance(e, (Finished, Error))]
    assert terminal == [len(events) - 1]


def tokens_of(events, index: int = 0) -> list[int]:
    return [t for e in events if isinstance(e, Tokens) and e.index == index for t in e.token_ids]


@pytest.fixture(scope="module")
def prompts_200():
    rng = random.Random(7)
    return [[rng.randrange(5, 500) for _ in range(rng.randint(1, 60))] for _ in range(200)]


@pytest.fixture
def worker(llama_dir, redis_url):
    w = WorkerProc(llama_dir, redis_url, "--max-num-seqs", "64", "--max-model-len", "512").start()
    yield w
    w.stop()


def test_200_requests_match_the_offline_engine(llama_dir, redis_url, worker, prompts_200):
    max_tokens = [4 + i % 13 for i in range(200)]
    llm = LLM(model=str(llama_dir), dtype="float32", device="cpu")
    offline = llm.generate(
        prompts_200, [SamplingParams(temperature=0, max_tokens=m) for m in max_tokens], use_tqdm=False
    )

    async def main():
        async with AsyncClient(redis_url) as client:
            handles = await client.submit_many(
                [{"prompt_token_ids": p, "max_tokens": m, "temperature": 0} for p, m in zip(prompts_200, max_tokens)]
            )
            return handles, await asyncio.gather(*(h.result(timeout=120) for h in handles))

    handles, results = asyncio.run(main())
    for h, res, off in zip(handles, results, offline, strict=True):
        assert res.token_ids == off.outputs[0].token_ids
        assert res.text == off.outputs[0].text
        assert res.finish_reason == off.outputs[0].finish_reason
        events = response_events(redis_url, h.request_id)
        check_stream(events)
        assert isinstance(events[0], Started) and events[0].worker == "w1"
        assert res.usage.completion_tokens == len(res.token_ids)
    wait_acked(redis_url)  # every entry acked and deleted


def test_late_reader_reads_everything(redis_url, worker):
    with Client(redis_url) as client:
        handle = client.submit("late reader", max_tokens=12, temperature=0, ignore_eos=True)
        wait_until(
            lambda: any(isinstance(e, Finished) for e in response_events(redis_url, handle.request_id)),
            what="the request to finish",
        )
        chunks = list(client.handle(handle.request_id).stream())
        assert sum(len(c.token_ids) for c in chunks) == 12
        again = client.handle(handle.request_id).result()
        assert again.token_ids == [t for c in chunks for t in c.token_ids]


def test_cancel_mid_generation_frees_blocks(redis_url, worker):
    with Client(redis_url) as client:
        handle = client.submit("cancel me", max_tokens=100_000, temperature=0, ignore_eos=True)
        wait_until(lambda: len(tokens_of(response_events(redis_url, handle.request_id))) >= 3, what="tokens to flow")
        handle.cancel()
        with pytest.raises(Cancelled):
            handle.result(timeout=30)
    events = response_events(redis_url, handle.request_id)
    check_stream(events)
    assert events[-1].finish_reason == "abort"
    wait_until(lambda: worker.metric("pagedq_kv_cache_usage_perc") == 0.0, what="KV blocks to be freed")
    assert worker.metric("pagedq_num_requests_running") == 0


def test_past_deadline_costs_no_forward_pass(redis_url, worker):
    with Client(redis_url) as client:
        client.generate("warm up", max_tokens=2)
        steps = worker.metric("pagedq_iteration_tokens_count")
        handle = client.submit("too late", max_tokens=5, deadline=-1.0)
        events = wait_until(lambda: response_events(redis_url, handle.request_id), what="an answer")
    assert [type(e) for e in events] == [Finished] and events[0].finish_reason == "deadline"
    assert worker.metric("pagedq_iteration_tokens_count") == steps


def _raw(rid: str, **fields) -> bytes:
    body = {"v": 1, "request_id": rid, "prompt": "hi", **fields}
    return msgspec.msgpack.encode({k: v for k, v in body.items() if v is not ...})


# name: (request id in the entry's `id` field, payload, expected error code)
MALFORMED = {
    "not-msgpack": ("not-msgpack-01", b"\xc1\xc1 definitely not msgpack", "malformed"),
    "unknown-version": ("bad-version-01", _raw("bad-version-01", v=99), "unsupported_version"),
    "missing-request-id": ("missing-id-0001", _raw("missing-id-0001", request_id=...), "schema"),
    "wrong-type": ("wrong-type-0001", _raw("wrong-type-0001", sampling={"max_tokens": "ten"}), "schema"),
    "two-prompts": ("two-prompts-001", _raw("two-prompts-001", prompt_token_ids=[1, 2, 3]), "invalid"),
    "no-prompt": ("no-prompt-0001", _raw("no-prompt-0001", prompt=...), "invalid"),
    "negative-max-tokens": ("neg-max-tok-001", _raw("neg-max-tok-001", sampling={"max_tokens": -5}), "invalid"),
    "huge-max-tokens": ("huge-max-tok-01", _raw("huge-max-tok-01", sampling={"max_tokens": 10**12}), "invalid"),
    "prompt-too-long": (
        "too-long-prompt",
        _raw("too-long-prompt", prompt=..., prompt_token_ids=[7] * 600),
        "prompt_too_long",
    ),
    "oversized": ("oversized-00001", _raw("oversized-00001", prompt="x" * (2 << 20)), "too_large"),
    "bad-request-id": ("../../etc/passwd", _raw("../../etc/passwd"), "invalid"),
    "unknown-field": ("unknown-field-1", _raw("unknown-field-1", temperature=0.5), "schema"),
    "bad-role": (
        "bad-role-00001",
        _raw("bad-role-00001", prompt=..., messages=[{"role": "wizard", "content": "x"}]),
        "invalid",
    ),
    "mismatched-id": ("entry-id-00001", _raw("payload-id-0001"), "schema"),
    "no-payload": ("no-payload-0001", None, "malformed"),
}


def test_malformed_entries_are_refused_and_good_ones_served(redis_url, worker):
    r = connect(redis_url, asyncio=False, socket_timeout=10)
    stream = keys.lane_stream("default")
    entry_ids = {}
    with Client(redis_url) as client:
        good_before = client.submit("good before", max_tokens=6, temperature=0, ignore_eos=True)
        for name, (rid, payload, _code) in MALFORMED.items():
            fields = {"id": rid} if payload is None else {"id": rid, "d": payload}
            entry_ids[name] = r.xadd(stream, fields).decode()
        good_after = client.submit("good after", max_tokens=6, temperature=0, ignore_eos=True)
        for h in (good_before, good_after):
            res = h.result(timeout=60)
            assert len(res.token_ids) == 6 and res.finish_reason == "length"

    wait_until(lambda: r.xlen(keys.dead_letters("default")) >= len(MALFORMED), what="dead letters")
    dead = {f[b"entry"].decode(): f for _, f in r.xrange(keys.dead_letters("default"))}
    for name, (rid, _payload, code) in MALFORMED.items():
        f = dead[entry_ids[name]]
        assert f[b"code"].decode() == code, f"{name}: {f[b'reason']!r}"
        assert f[b"reason"]
        if name == "bad-request-id":  # an unsafe id is never used in a key name
            assert f[b"id"] == b""
            continue
        events = response_events(redis_url, rid)
        assert len(events) == 1 and isinstance(events[0], Error) and events[0].code == code, name
    assert not r.keys("pagedq:resp:*etc*")
    assert r.xlen(stream) == 0
    with Client(redis_url) as client, pytest.raises(RequestFailed) as err:
        client.handle("too-long-prompt").result(timeout=10)
    assert "prompt" in str(err.value) and err.value.code == "prompt_too_long"


def test_two_workers_share_the_load(llama_dir, redis_url):
    a = WorkerProc(llama_dir, redis_url, "--max-num-seqs", "4", name="wa", metrics=False).start()
    b = WorkerProc(llama_dir, redis_url, "--max-num-seqs", "4", name="wb", metrics=False).start()
    try:
        with Client(redis_url) as client:
            handles = client.submit_many(
                [{"prompt": f"request {i}", "max_tokens": 8, "temperature": 0, "ignore_eos": True} for i in range(100)]
            )
            for h in handles:
                h.result(timeout=120)
        served = {"wa": 0, "wb": 0}
        for h in handles:
            started = [e for e in response_events(redis_url, h.request_id) if isinstance(e, Started)]
            served[started[0].worker] += 1
        # Each worker pulls only what it has room for (4 slots), so neither can hoard the queue;
        # the split is not exactly even because the two processes share two CPU cores.
        assert min(served.values()) >= 20, served
    finally:
        a.stop()
        b.stop()


def test_sigterm_drains_in_flight_work_and_exits_zero(llama_dir, redis_url):
    w = WorkerProc(llama_dir, redis_url, "--drain-timeout", "60", metrics=False).start()
    with Client(redis_url) as client:
        handles = [client.submit(f"drain {i}", max_tokens=30, temperature=0, ignore_eos=True) for i in range(5)]
        wait_until(
            lambda: all(tokens_of(response_events(redis_url, h.request_id)) for h in handles),
            what="all requests to be running",
        )
        w.signal(15)
        for h in handles:
            assert len(h.result(timeout=60).token_ids) == 30
    assert w.wait(60) == 0
    assert not connect(redis_url, asyncio=False, socket_timeout=10).exists(keys.worker_state("default", "w1"))


def test_sigkill_with_requests_in_flight_then_another_worker_resumes(llama_dir, redis_url):
    prompts = [f"crash test {i} " * (1 + i % 5) for i in range(20)]
    llm = LLM(model=str(llama_dir), dtype="float32", device="cpu")
    reference = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=120, ignore_eos=True), use_tqdm=False)

    slow = {"PAGEDQ_FAULT_STEP_DELAY_S": "0.02"}  # each step at least 20 ms: surely mid-flight when killed
    first = WorkerProc(llama_dir, redis_url, "--max-num-seqs", "32", name="first", metrics=False, env=slow).start()

    async def main():
        async with AsyncClient(redis_url) as client:
            handles = [
                await client.submit(p, max_tokens=120, temperature=0, ignore_eos=True, request_id=f"crash-{i:04d}")
                for i, p in enumerate(prompts)
            ]

            async def read(h):
                chunks = [c async for c in h.stream(timeout=120)]
                return [t for c in chunks for t in c.token_ids]

            readers = [asyncio.create_task(read(h)) for h in handles]

            def some_progress():
                got = [len(tokens_of(response_events(redis_url, h.request_id))) for h in handles]
                return sum(0 < g < 120 for g in got) >= 10  # mid-generation

            await asyncio.to_thread(wait_until, some_progress, 60, "tokens in flight")
            first.kill()
            second = WorkerProc(llama_dir, redis_url, "--claim-idle-ms", "1000", name="second", metrics=False)
            await asyncio.to_thread(second.start)
            try:
                return await asyncio.gather(*readers)
            finally:
                second.stop()

    streamed = asyncio.run(main())
    resumed = 0
    for i, (got, ref) in enumerate(zip(streamed, reference, strict=True)):
        assert got == ref.outputs[0].token_ids, f"request {i} differs from the uninterrupted run"
        events = response_events(redis_url, f"crash-{i:04d}")
        check_stream(events)
        starts = [e for e in events if isinstance(e, Started)]
        resumed += len(starts) > 1
        if len(starts) > 1:
            assert [s.worker for s in starts] == ["first", "second"] and starts[1].attempt == 2
    assert resumed >= 1
    first.stop()


def test_prometheus_metrics_are_served(redis_url, worker):
    with Client(redis_url) as client:
        client.generate("metrics", max_tokens=5, temperature=0, ignore_eos=True)
    wait_until(lambda: worker.metric("pagedq_generation_tokens_total") >= 5, what="generation counter")
    # (a request is counted once its entry is acked, a round trip after its final event)
    wait_until(
        lambda: worker.metric("pagedq_request_success_total", finished_reason="length") >= 1, what="success counter"
    )
    assert worker.metric("pagedq_time_to_first_token_seconds_count") >= 1
    assert worker.metric("pagedq_e2e_request_latency_seconds_count") >= 1
    # The Grafana dashboard and the alert rules only use series this worker really exports (the gateway
    # rows are checked against a gateway in tests/service/test_ops_files.py).
    from tests.service.test_ops_files import exposed_sample_names, referenced_metrics

    worker_series = {name for name in referenced_metrics() if not name.startswith("pagedq_gateway_")}
    missing = worker_series - exposed_sample_names(worker.metrics_text())
    assert not missing, missing


def test_worker_says_how_it_parses_redis_replies(worker):
    # the worker extra brings hiredis; a worker without it says "python" (tests/unit/test_reply_parser.py)
    # (start() returns at the first heartbeat, a moment before the log line)
    started = wait_until(
        lambda: [e for e in worker.log_events() if e.get("event") == "worker started"], what="worker started"
    )
    assert started[0]["redis_parser"] == "hiredis"


def test_sdk_against_a_real_worker_chat_timeout_queue_full(llama_dir, redis_url):
    from producer_sdk.errors import QueueFull, RequestTimeout

    w = WorkerProc(llama_dir, redis_url, "--max-queue-len", "2", "--max-num-seqs", "8", metrics=False).start()
    try:
        with Client(redis_url) as client:
            chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
            res = client.generate(messages=chat, max_tokens=8, temperature=0)
            llm = LLM(model=str(llama_dir), dtype="float32", device="cpu")
            offline = llm.chat(chat, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
            assert res.token_ids == offline.outputs[0].token_ids
            assert res.usage.prompt_tokens == len(offline.prompt_token_ids)

            with pytest.raises(RequestTimeout):
                client.generate("slow one", max_tokens=100_000, ignore_eos=True, timeout=0.5, cancel_on_timeout=True)
            wait_until(lambda: client.queue_stats().lanes["normal"] == 0, what="the timed-out request to be cancelled")

            long = [client.submit(f"long {i}", max_tokens=100_000, ignore_eos=True) for i in range(2)]
            with pytest.raises(QueueFull):
                client.submit("one too many", max_tokens=4)
            for h in long:
                h.cancel()
                with pytest.raises(Cancelled):
                    h.result(timeout=30)
            assert client.generate("room again", max_tokens=3, ignore_eos=True).finish_reason == "length"
    finally:
        w.stop()


@pytest.mark.single_node
def test_arq_bridge_through_a_real_worker(llama_dir, redis_url):
    from arq.connections import RedisSettings, create_pool

    from producer_sdk.arq_bridge import enqueue_generation

    w = WorkerProc(llama_dir, redis_url, "--arq-queue", "pagedq:arq:it", metrics=False).start()

    async def main():
        pool = await create_pool(RedisSettings.from_dsn(redis_url))
        try:
            jobs = [
                await enqueue_generation(
                    pool, queue_name="pagedq:arq:it", prompt=f"arq {i}", max_tokens=6, temperature=0, ignore_eos=True
                )
                for i in range(3)
            ]
            return [await j.result(timeout=60) for j in jobs]
        finally:
            await pool.aclose()

    try:
        results = asyncio.run(main())
    finally:
        w.stop()
    llm = LLM(model=str(llama_dir), dtype="float32", device="cpu")
    offline = llm.generate(
        [f"arq {i}" for i in range(3)], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False
    )
    assert [r["token_ids"] for r in results] == [o.outputs[0].token_ids for o in offline]
    assert all(r["finish_reason"] == "length" and r["worker"] == "w1" for r in results)


def test_cancel_right_after_submit_is_never_lost(redis_url, worker):
    """Cancels sent right after submit (while intake may be admitting the request) all take effect."""
    with Client(redis_url) as client:
        handles = []
        for i in range(20):
            h = client.submit(f"cancel at once {i}", max_tokens=2000, ignore_eos=True)
            h.cancel()
            handles.append(h)
        for h in handles:
            with pytest.raises(Cancelled):
                h.result(timeout=30)


def test_two_entries_of_one_request_read_together_run_it_once(llama_dir, redis_url):
    """A request submitted again after its marker expired (it waited longer than its result TTL) has
    two entries. Read in one batch, the newer one runs and the older one is dropped as a duplicate,
    at once: the request is answered, every entry deleted and counted down, nothing left for the
    claim timeout (set far beyond the test here)."""
    r = connect(redis_url, asyncio=False, socket_timeout=10)
    with Client(redis_url) as client:
        client.submit("warm", max_tokens=2, request_id="twice-warm")  # the worker's first read admits one entry
        first = client.submit("twice", max_tokens=3, temperature=0, ignore_eos=True, request_id="twice-request")
        r.delete(keys.submitted_marker("default", "twice-request"))
        second = client.submit("twice", max_tokens=3, temperature=0, ignore_eos=True, request_id="twice-request")
        assert not second.duplicate and second.entry_id != first.entry_id
        w = WorkerProc(llama_dir, redis_url, "--claim-idle-ms", "600000").start()
        try:
            assert len(second.result(timeout=30).token_ids) == 3
            wait_acked(redis_url)
            assert r.hgetall(keys.tenant_queued("default")) == {}
            letters = [fields for _, fields in r.xrange(keys.dead_letters("default"))]
            assert [(f[b"code"], f[b"entry"].decode()) for f in letters] == [(b"duplicate", first.entry_id)]
            check_stream(response_events(redis_url, "twice-request"))
        finally:
            w.stop()
            r.close()


def test_entries_of_two_lanes_with_the_same_id_are_both_served(llama_dir, redis_url):
    """Stream ids are per stream: two lanes hand out the same id when two requests are enqueued in the
    same millisecond. The worker tells entries apart by lane and id; read together, both are served."""
    from producer_sdk._core import build_request
    from producer_sdk.contract.keys import ENTRY_DATA_FIELD, ENTRY_ID_FIELD, ENTRY_TENANT_FIELD

    r = connect(redis_url, asyncio=False, socket_timeout=10)
    ids = {"high": "same-id-high", "normal": "same-id-normal"}
    for lane, rid in ids.items():
        p = build_request("same id", max_tokens=2, priority=1 if lane == "high" else 0, request_id=rid)
        fields = {ENTRY_ID_FIELD: rid, ENTRY_TENANT_FIELD: "default", ENTRY_DATA_FIELD: p.payload}
        r.xadd(keys.lane_stream("default", lane), fields, id="1000-0")
        r.set(keys.submitted_marker("default", rid), 1, ex=120)  # what the enqueue step sets
    w = WorkerProc(llama_dir, redis_url).start()
    try:
        with Client(redis_url) as client:
            for rid in ids.values():
                assert len(client.handle(rid).result(timeout=30).token_ids) == 2
        wait_acked(redis_url)
    finally:
        w.stop()
        r.close()
