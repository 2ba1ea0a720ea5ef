"""Tenants and their quotas against a real redis-server: the enqueue step itself (time passed in, so
windows need no sleeping), the ack that gives a queued slot back and counts a request's tokens once,
the recount, the SDK's RateLimited (with real workers for tokens_per_minute), the `pagedq tenant`
command, and the worker's bounded tenant labels."""

from __future__ import annotations

import json
import time

import pytest

from producer_sdk import AsyncClient, Client, RateLimited, ValidationError, tenants
from producer_sdk.contract import keys, scripts, steps
from producer_sdk.contract.connection import connect
from producer_sdk.protocol import Finished, Started, encode_event
from tests.service.worker_proc import WorkerProc, response_events, wait_until
from worker.cli import main as pagedq
from worker.service.inflight import Entry
from worker.service.metrics import OTHER_TENANT, TenantLabels, WorkerMetrics

MODEL = "default"
GROUP = keys.group(MODEL)
MINUTE = scripts.RATE_WINDOW_MS
T0 = 1_000 * MINUTE  # the start of a window


@pytest.fixture
def r(redis_url):
    client = connect(redis_url, asyncio=False, socket_timeout=10)
    for lane in keys.LANES:
        client.xgroup_create(keys.lane_stream(MODEL, lane), GROUP, id="0", mkstream=True)
    yield client
    client.close()


def enqueue(r, rid, tenant, *, now_ms=0, model=MODEL) -> scripts.EnqueueReply:
    """As the SDK submits: the tenant's quota read, then the enqueue step."""
    quota = scripts.read_quota(r.hmget(keys.tenant_quota(tenant), list(scripts.QUOTA_FIELDS)))
    ks, args = scripts.enqueue_call(model, "normal", rid, b"payload", None, 60_000, tenant, quota, now_ms=now_ms)
    return scripts.read_enqueue(steps.ENQUEUE.run_sync(r, ks, args))


def queued(r, tenant, model=MODEL) -> int:
    return int(r.hget(keys.tenant_queued(model), tenant) or 0)


def take(r, consumer="w1") -> tuple[str, dict]:
    got = r.xreadgroup(GROUP, consumer, {keys.lane_stream(MODEL): ">"}, count=1)
    entry_id, fields = got[0][1][0]
    return entry_id.decode(), fields


def finish(r, rid, entry_id, consumer="w1", *, tenant="default", tokens=0, now_ms=0, deliveries=1) -> str:
    """As a worker ends a request: its lease for this delivery, the final event, the ack. "lost" when
    another delivery holds the lease, else "ok" when the ack deleted the entry ("done": it was gone)."""
    epoch = scripts.lease_epoch(entry_id, deliveries)
    ks, args = scripts.acquire_call(rid, owner=consumer, epoch=epoch, ttl_ms=60_000)
    if not scripts.read_acquire(steps.ACQUIRE.run_sync(r, ks, args)).ok:
        return "lost"
    ks, args = scripts.publish_call(
        rid,
        owner=consumer,
        epoch=epoch,
        cap=0,
        live_ttl_ms=60_000,
        result_ttl_ms=60_000,
        first_seq=0,
        events=[encode_event(Finished(seq=0, finish_reason="stop"))],
        final=True,
    )
    if scripts.read_publish(steps.PUBLISH.run_sync(r, ks, args)).status != "ok":
        return "lost"
    ks, args = scripts.ack_call(
        MODEL, "normal", rid, group=GROUP, entry_id=entry_id, result_ttl_ms=60_000, tenant=tenant, tokens=tokens,
        now_ms=now_ms,
    )  # fmt: skip
    return "ok" if scripts.read_ack(steps.ACK.run_sync(r, ks, args)) else "done"


def time_left_in_window(r, at_least_s: float) -> int:
    """Wait, if need be, until the current window of the Redis clock has at least `at_least_s` left, so
    that what a test does next falls in one window; returns that window's number."""
    seconds, micros = r.time()
    now = seconds * 1000 + micros // 1000
    left = MINUTE - now % MINUTE
    if left < at_least_s * 1000:
        time.sleep(left / 1000 + 0.05)
        return now // MINUTE + 1
    return now // MINUTE


def tokens_window(r, tenant) -> tuple[int, int] | None:
    """(window number, tokens) of the tenant's token window hash, None when there is none."""
    w, n = r.hmget(keys.tenant_tokens(MODEL, tenant), ["w", "n"])
    return None if w is None else (int(w), int(n))


# --- the enqueue step -------------------------------------------------------------------------------


def test_max_queued_is_per_tenant_and_per_model(r):
    tenants.set_quota(r, "team-a", max_queued=2)
    assert enqueue(r, "req-a-000001", "team-a").status == "ok"
    assert enqueue(r, "req-a-000002", "team-a").status == "ok"
    over = enqueue(r, "req-a-000003", "team-a")
    assert over == scripts.EnqueueReply(
        "limited", queued=2, limit=2, quota="max_queued", retry_after_ms=scripts.QUEUED_RETRY_AFTER_MS
    )
    assert not r.exists(keys.submitted_marker(MODEL, "req-a-000003"))  # nothing of it was written
    assert enqueue(r, "req-b-000001", "team-b").status == "ok"  # another tenant is unaffected
    assert enqueue(r, "req-a-other1", "team-a", model="other").status == "ok"  # another model's queue
    assert (queued(r, "team-a"), queued(r, "team-b"), queued(r, "team-a", "other")) == (2, 1, 1)
    assert r.xlen(keys.lane_stream(MODEL)) == 3
    tenants_of = [f[keys.ENTRY_TENANT_FIELD.encode()] for _, f in r.xrange(keys.lane_stream(MODEL))]
    assert tenants_of == [b"team-a", b"team-a", b"team-b"]


def test_the_ack_gives_the_slot_back_once(r):
    tenants.set_quota(r, "team-a", max_queued=1)
    assert enqueue(r, "req-a-000001", "team-a").status == "ok"
    entry_id, _ = take(r)
    assert queued(r, "team-a") == 1  # taken by a worker, not finished: still outstanding
    assert enqueue(r, "req-a-000002", "team-a").status == "limited"
    assert finish(r, "req-a-000001", entry_id) == "ok"
    assert queued(r, "team-a") == 0 and not r.hexists(keys.tenant_queued(MODEL), "team-a")
    assert finish(r, "req-a-000001", entry_id) == "done"  # a retry after a lost reply
    assert enqueue(r, "req-a-000002", "team-a").status == "ok"
    assert queued(r, "team-a") == 1  # the retry did not count the entry down twice

    # A refused entry (dropped: no addressable response stream) gives its slot back too.
    entry_id, _ = take(r)
    letter = scripts.DeadLetter("", "malformed", "bad", "normal", entry_id, "w1", b"", 0, "", "0-0")
    ks, args = scripts.drop_call(MODEL, "normal", group=GROUP, consumer="w1", entry_id=entry_id, dead_letter=letter)
    assert steps.DROP.run_sync(r, ks, args) == b"ok"
    assert queued(r, "team-a") == 0


def test_requests_per_minute_is_a_window_per_model(r):
    tenants.set_quota(r, "team-a", requests_per_minute=2)
    assert enqueue(r, "req-a-000001", "team-a", now_ms=T0 + 500).status == "ok"
    assert enqueue(r, "req-a-000002", "team-a", now_ms=T0 + 900).status == "ok"
    over = enqueue(r, "req-a-000003", "team-a", now_ms=T0 + 1_000)
    assert over.status == "limited" and over.quota == "requests_per_minute"
    assert (over.queued, over.limit, over.retry_after_ms) == (2, 2, MINUTE - 1_000)
    assert enqueue(r, "req-a-other1", "team-a", now_ms=T0 + 1_000, model="other").status == "ok"  # its own window
    # A resubmit of an accepted id follows it and is not counted; a refused request is not counted.
    assert enqueue(r, "req-a-000001", "team-a", now_ms=T0 + 2_000).status == "duplicate"
    assert r.hmget(keys.tenant_rate(MODEL, "team-a"), ["w", "n"]) == [str(T0 // MINUTE).encode(), b"2"]
    assert enqueue(r, "req-b-000001", "team-b", now_ms=T0 + 2_000).status == "ok"  # no quota: unlimited
    # The next window starts from zero.
    assert enqueue(r, "req-a-000003", "team-a", now_ms=T0 + MINUTE).status == "ok"
    assert r.hget(keys.tenant_rate(MODEL, "team-a"), "n") == b"1"
    assert 0 < r.pttl(keys.tenant_rate(MODEL, "team-a")) <= 2 * MINUTE


def test_requests_per_minute_on_the_redis_clock(r):
    tenants.set_quota(r, "team-a", requests_per_minute=1)
    # Three submits within milliseconds cross at most one window boundary: one of them is refused.
    replies = [enqueue(r, f"req-clock-{i:04d}", "team-a") for i in range(3)]
    refused = [x for x in replies if x.status == "limited"]
    assert refused and all(0 < x.retry_after_ms <= MINUTE for x in refused)


def test_tokens_per_minute_refuses_once_the_window_is_used(r):
    tenants.set_quota(r, "team-a", tokens_per_minute=100)
    window = T0 // MINUTE
    assert enqueue(r, "req-tok-00001", "team-a", now_ms=T0 + 100).status == "ok"
    entry_id, _ = take(r)
    assert finish(r, "req-tok-00001", entry_id, tenant="team-a", tokens=60, now_ms=T0 + 500) == "ok"
    assert tokens_window(r, "team-a") == (window, 60)
    # 60 of 100 used: admitted (consumption is measured after the fact, so this one may overshoot).
    assert enqueue(r, "req-tok-00002", "team-a", now_ms=T0 + 1_000).status == "ok"
    entry_id, _ = take(r)
    assert finish(r, "req-tok-00002", entry_id, tenant="team-a", tokens=50, now_ms=T0 + 1_500) == "ok"
    assert tokens_window(r, "team-a") == (window, 110)
    over = enqueue(r, "req-tok-00003", "team-a", now_ms=T0 + 2_000)
    assert over == scripts.EnqueueReply(
        "limited", queued=110, limit=100, quota="tokens_per_minute", retry_after_ms=MINUTE - 2_000
    )
    assert not r.exists(keys.submitted_marker(MODEL, "req-tok-00003"))  # nothing of it was written
    assert enqueue(r, "req-tok-other", "team-a", now_ms=T0 + 2_000, model="other").status == "ok"  # per model
    assert enqueue(r, "req-tok-b0001", "team-b", now_ms=T0 + 2_000).status == "ok"  # another tenant
    take(r)  # (team-b's entry, left running)
    assert 0 < r.pttl(keys.tenant_tokens(MODEL, "team-a")) <= 2 * MINUTE
    # Exactly at the limit is refused too; the next window starts from zero.
    r.hset(keys.tenant_tokens(MODEL, "team-a"), "n", 100)
    assert enqueue(r, "req-tok-00003", "team-a", now_ms=T0 + MINUTE - 1).retry_after_ms == 1
    assert enqueue(r, "req-tok-00003", "team-a", now_ms=T0 + MINUTE).status == "ok"
    entry_id, _ = take(r)
    assert finish(r, "req-tok-00003", entry_id, tenant="team-a", tokens=7, now_ms=T0 + MINUTE + 10) == "ok"
    assert tokens_window(r, "team-a") == (window + 1, 7)


def test_the_ack_counts_the_tokens_once(r):
    tenants.set_quota(r, "team-a", tokens_per_minute=1_000)
    enqueue(r, "req-once-0001", "team-a")
    entry_id, _ = take(r)
    assert finish(r, "req-once-0001", entry_id, tenant="team-a", tokens=30, now_ms=T0) == "ok"
    # The same calls again (their replies were lost): the entry is gone, the tokens are not added again.
    assert finish(r, "req-once-0001", entry_id, tenant="team-a", tokens=30, now_ms=T0) == "done"
    assert tokens_window(r, "team-a") == (T0 // MINUTE, 30)

    # A worker whose delivery another worker took over writes nothing and counts nothing.
    enqueue(r, "req-once-0002", "team-a")
    entry_id, _ = take(r)
    r.xclaim(keys.lane_stream(MODEL), GROUP, "w2", 0, [entry_id])  # the second delivery
    assert finish(r, "req-once-0002", entry_id, "w2", tenant="team-a", tokens=40, now_ms=T0, deliveries=2) == "ok"
    assert finish(r, "req-once-0002", entry_id, "w1", tenant="team-a", tokens=40, now_ms=T0) == "lost"
    assert tokens_window(r, "team-a") == (T0 // MINUTE, 70)

    # Counted only for the entry's own tenant: an older SDK's entry (no `t`) counts against nothing,
    # nor does a tenant given that is not the entry's.
    r.xadd(keys.lane_stream(MODEL), {"id": "req-old-sdk-01", "d": b"p"})
    entry_id, _ = take(r)
    assert finish(r, "req-old-sdk-01", entry_id, tenant="team-a", tokens=50, now_ms=T0) == "ok"
    enqueue(r, "req-once-0003", "team-b")
    entry_id, _ = take(r)
    assert finish(r, "req-once-0003", entry_id, tenant="team-a", tokens=50, now_ms=T0) == "ok"
    assert tokens_window(r, "team-a") == (T0 // MINUTE, 70)

    # A tenant without a tokens_per_minute quota is counted all the same (a quota set later applies at
    # once); the window expires on its own.
    enqueue(r, "req-once-0004", "team-c")
    entry_id, _ = take(r)
    assert finish(r, "req-once-0004", entry_id, tenant="team-c", tokens=50, now_ms=T0) == "ok"
    assert r.hget(keys.tenant_tokens(MODEL, "team-c"), "n") == b"50"
    assert 0 < r.pttl(keys.tenant_tokens(MODEL, "team-c")) <= 2 * MINUTE


def test_recount_repairs_the_counts(r):
    for i, tenant in enumerate(["team-a", "team-a", "team-b"]):
        enqueue(r, f"req-count-{i:04d}", tenant)
    r.xadd(keys.lane_stream(MODEL, "high"), {"id": "req-old-sdk-01", "d": b"p"})  # an older SDK's: no tenant
    r.hset(keys.tenant_queued(MODEL), mapping={"team-a": 99, "gone": 5})
    assert tenants.recount(r, MODEL) == {"team-a": 2, "team-b": 1}
    assert r.hgetall(keys.tenant_queued(MODEL)) == {b"team-a": b"2", b"team-b": b"1"}


# --- the SDK ----------------------------------------------------------------------------------------


async def test_sdk_raises_rate_limited_and_other_tenants_go_on(redis_url, r):
    tenants.set_quota(r, "team-a", max_queued=1)
    async with AsyncClient(redis_url, MODEL, tenant="team-a") as a:
        assert a.tenant == "team-a"
        await a.submit("first")
        with pytest.raises(RateLimited) as e:
            await a.submit("second")
        assert (e.value.tenant, e.value.quota, e.value.used, e.value.limit) == ("team-a", "max_queued", 1, 1)
        assert e.value.retry_after > 0
        handle = await a.submit("per call", tenant="team-b")  # the call's tenant wins
        with pytest.raises(ValidationError) as bad:
            await a.submit("x", tenant="no spaces")
        assert bad.value.field == "tenant"
        with pytest.raises(RateLimited) as many:
            await a.submit_many(["one", {"prompt": "two", "tenant": "team-c"}])
        assert many.value.handles[0] is None and many.value.handles[1] is not None
    with Client(redis_url, MODEL) as anyone:  # no tenant: "default", no quota
        anyone.submit("unlimited")
    assert (queued(r, "team-a"), queued(r, "team-b"), queued(r, "team-c"), queued(r, "default")) == (1, 1, 1, 1)
    fields = dict(r.xrange(keys.lane_stream(MODEL)))[handle.entry_id.encode()]
    assert fields[keys.ENTRY_TENANT_FIELD.encode()] == b"team-b"
    with pytest.raises(ValidationError):
        Client(redis_url, MODEL, tenant="x" * 33)


def test_a_worker_counts_finished_tokens_and_the_next_submit_is_refused(llama_dir, redis_url, r):
    tenants.set_quota(r, "team-a", tokens_per_minute=5)
    w = WorkerProc(llama_dir, redis_url, metrics=False).start()
    try:
        with Client(redis_url, MODEL, tenant="team-a") as a, Client(redis_url, MODEL, tenant="team-b") as b:
            window = time_left_in_window(r, 10)
            done = a.generate("hello there", max_tokens=4, temperature=0, ignore_eos=True, timeout=60)
            used = done.usage.prompt_tokens + done.usage.completion_tokens
            assert done.usage.completion_tokens == 4 and used > 5  # admitted under the limit, overshoots it
            # Counted by the ack, which follows the final event the reader has just seen.
            wait_until(lambda: tokens_window(r, "team-a") is not None, 10, "the ack's token count")
            assert tokens_window(r, "team-a") == (window, used)
            with pytest.raises(RateLimited) as e:
                a.submit("again", max_tokens=4)
            assert (e.value.tenant, e.value.quota, e.value.used, e.value.limit) == (
                "team-a",
                "tokens_per_minute",
                used,
                5,
            )
            assert 0 < e.value.retry_after <= 60
            other = b.generate("another tenant", max_tokens=2, temperature=0, ignore_eos=True, timeout=60)
            assert other.finish_reason == "length"
            wait_until(lambda: tokens_window(r, "team-b") is not None, 10, "the ack's token count")
            assert tokens_window(r, "team-b")[1] == other.usage.prompt_tokens + 2  # counted, though unlimited
    finally:
        w.stop()


def test_a_request_resumed_after_a_crash_counts_its_tokens_once(llama_dir, redis_url, r):
    """The doomed worker dies right before its final publish, which is where the tokens are counted;
    the rescuer resumes the request, and its final publish counts the whole usage, once."""
    tenants.set_quota(r, "team-a", tokens_per_minute=1_000_000)
    env = {"PAGEDQ_FAULT_EXIT_BEFORE_FINAL_PUBLISH": "1", "PAGEDQ_FAULT_STEP_DELAY_S": "0.02"}
    doomed = WorkerProc(llama_dir, redis_url, name="doomed", metrics=False, env=env).start()
    rescuer = WorkerProc(llama_dir, redis_url, "--claim-idle-ms", "1000", name="rescuer", metrics=False)
    try:
        with Client(redis_url, MODEL, tenant="team-a") as a:
            before = time_left_in_window(r, 0)
            handle = a.submit("resume me", max_tokens=8, temperature=0, ignore_eos=True)
            wait_until(lambda: doomed.proc.poll() is not None, 60, "the doomed worker's exit")
            assert not r.exists(keys.tenant_tokens(MODEL, "team-a"))  # nothing counted without the final event
            rescuer.start()
            done = handle.result(timeout=60)
            after = time_left_in_window(r, 0)
        starts = [e for e in response_events(redis_url, handle.request_id) if isinstance(e, Started)]
        assert [s.worker for s in starts] == ["doomed", "rescuer"]  # it was resumed
        assert done.usage.completion_tokens == 8  # all of them, the doomed worker's included
        wait_until(lambda: tokens_window(r, "team-a") is not None, 10, "the ack's token count")
        window, used = tokens_window(r, "team-a")
        assert before <= window <= after and used == done.usage.prompt_tokens + done.usage.completion_tokens
    finally:
        doomed.stop()
        rescuer.stop()


def test_sync_client_requests_per_minute(redis_url, r):
    tenants.set_quota(r, "team-a", requests_per_minute=1)
    refused = []
    with Client(redis_url, MODEL, tenant="team-a") as a:
        for _ in range(3):  # at most one window boundary in between: one is refused
            try:
                a.submit("hi")
            except RateLimited as e:
                refused.append(e)
    assert refused and all(e.quota == "requests_per_minute" and 0 < e.retry_after <= 60 for e in refused)


# --- `pagedq tenant` ----------------------------------------------------------------------------------


def test_tenant_command(redis_url, r, capsys):
    url = ["--redis-url", redis_url]
    assert pagedq(["tenant", "set", "team-a", "--max-queued", "3", *url]) == 0
    enqueue(r, "req-cli-00001", "team-a")  # no requests_per_minute yet: not counted in a window
    enqueue(r, "req-cli-00002", "team-b")
    assert pagedq(["tenant", "set", "team-a", "--requests-per-minute", "10", *url]) == 0
    assert pagedq(["tenant", "set", "team-a", "--max-queued", "4", *url]) == 0  # the other field is kept
    capsys.readouterr()
    assert pagedq(["tenant", "show", "--json", *url]) == 0
    rows = {row["tenant"]: row for row in json.loads(capsys.readouterr().out)}
    assert rows["team-a"]["quota"] == {
        "tenant": "team-a",
        "max_queued": 4,
        "requests_per_minute": 10,
        "tokens_per_minute": 0,
    }
    assert rows["team-a"]["queued"] == {MODEL: 1} and rows["team-a"]["requests_this_minute"] == {MODEL: 0}
    assert rows["team-b"]["queued"] == {MODEL: 1} and rows["team-b"]["requests_this_minute"] is None
    assert pagedq(["tenant", "show", "team-a", *url]) == 0
    assert "team-a" in capsys.readouterr().out
    assert pagedq(["tenant", "recount", "--model-name", MODEL, *url]) == 0
    assert capsys.readouterr().out.strip() == "team-a 1, team-b 1"
    assert pagedq(["tenant", "delete", "team-a", *url]) == 0
    assert tenants.get_quota(r, "team-a") == tenants.TenantQuota(tenant="team-a")
    assert pagedq(["tenant", "set", "bad name", "--max-queued", "1", *url]) == 1
    assert pagedq(["tenant", "set", "team-a", "--max-queued", "-1", *url]) == 1


def test_tenant_command_tokens_per_minute(redis_url, r, capsys):
    url = ["--redis-url", redis_url]
    assert pagedq(["tenant", "set", "team-t", "--tokens-per-minute", "500", *url]) == 0
    assert "500 tokens per minute" in capsys.readouterr().out
    assert pagedq(["tenant", "set", "team-t", "--max-queued", "2", *url]) == 0  # tokens_per_minute is kept
    assert tenants.get_quota(r, "team-t") == tenants.TenantQuota(tenant="team-t", max_queued=2, tokens_per_minute=500)
    enqueue(r, "req-cli-tok01", "team-t")
    time_left_in_window(r, 5)
    entry_id, _ = take(r)
    assert finish(r, "req-cli-tok01", entry_id, tenant="team-t", tokens=120) == "ok"  # the Redis clock
    capsys.readouterr()
    assert pagedq(["tenant", "show", "team-t", "--json", *url]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["quota"] == {"tenant": "team-t", "max_queued": 2, "requests_per_minute": 0, "tokens_per_minute": 500}
    assert (row["tokens_this_minute"], row["requests_this_minute"]) == ({MODEL: 120}, None)
    assert pagedq(["tenant", "show", "team-t", *url]) == 0
    header, line = capsys.readouterr().out.splitlines()
    assert "tok/min" in header
    assert line.split() == ["team-t", "2", "-", "500", f"{MODEL}:", "queued", "0,", "120", "tok", "this", "min"]
    assert tenants.usage(r, tenants=["team-t"])[0].tokens_this_minute == {MODEL: 120}
    assert pagedq(["tenant", "set", "team-t", "--tokens-per-minute", "-1", *url]) == 1
    assert pagedq(["tenant", "delete", "team-t", *url]) == 0
    assert not r.exists(keys.tenant_tokens(MODEL, "team-t"))


# --- the worker's side ------------------------------------------------------------------------------


def test_tenant_labels_are_bounded():
    labels = TenantLabels(2)
    assert [labels(t) for t in ["a", "b", "c", "a", "d"]] == ["a", "b", OTHER_TENANT, "a", OTHER_TENANT]
    metrics = WorkerMetrics(MODEL, max_tenant_labels=1)
    metrics.tenant_finished("a", "stop", 5)
    metrics.tenant_finished("b", "stop", 7)
    text = metrics.render().decode()
    assert 'pagedq_tenant_requests_finished_total{finished_reason="stop",model="default",tenant="other"} 1.0' in text
    assert 'pagedq_tenant_completion_tokens_total{model="default",tenant="a"} 5.0' in text


def test_entry_tenant_field():
    entry = lambda fields: Entry("normal", "s", "1-0", fields)
    assert entry({b"t": b"team-a"}).tenant == "team-a"
    assert entry({}).tenant == "default"  # an older SDK's entry
    assert entry({b"t": b"bad name"}).tenant == "default"


def test_gateway_keys_name_valid_tenants_and_rate_limited_is_openais_429():
    from gateway.auth import KeyEntry, KeyFileError, KeyRing
    from gateway.errors import from_sdk

    with pytest.raises(KeyFileError, match="tenant"):
        KeyRing({"sk-1": KeyEntry("team a")})
    assert KeyRing({"sk-1": KeyEntry("team-a")}).caller("Bearer sk-1").tenant == "team-a"
    err = from_sdk(RateLimited("team-a", "requests_per_minute", 10, 10, 12.3451))
    assert err.status == 429 and err.headers == {"Retry-After": "13", "retry-after-ms": "12345"}
    body = json.loads(err.json())["error"]
    assert (body["type"], body["code"], body["param"]) == ("requests", "rate_limit_exceeded", None)
    assert "requests per min (RPM): Limit 10, Used 10, Requested 1. Please" in body["message"]
    err = from_sdk(RateLimited("team-a", "tokens_per_minute", 130, 100, 2.5))
    assert err.status == 429 and err.headers == {"Retry-After": "3", "retry-after-ms": "2500"}
    body = json.loads(err.json())["error"]
    assert (body["type"], body["code"]) == ("tokens", "rate_limit_exceeded")
    assert "tokens per min (TPM): Limit 100, Used 130. Please try again in 2.500s." in body["message"]
