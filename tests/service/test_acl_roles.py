"""Each component under its own ACL user, with the users `pagedq acl` writes, against a private
redis-server that loads them from an aclfile: a real worker, the SDK as producer, a real gateway
(chat completion, background response, batch) and an operator's read commands all work, and Redis
refuses none of their commands (ACL LOG stays empty). Then what the users must not do: a producer
cannot delete, trim or claim lane entries, write a response stream, ack, touch the consumer group or
another request's lease; an operator cannot write at all. And what ACLs cannot stop (`acl.LIMITS`)."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import time

import openai
import pytest
import redis

from producer_sdk import AsyncClient, Cancelled, Client, PermissionDenied, tenants
from producer_sdk.contract import acl, keys, scripts, steps
from producer_sdk.contract.connection import connect
from tests.gateway.gateway_proc import GatewayProc
from tests.service.worker_proc import WorkerProc, wait_until
from worker.service.redis_proc import RedisProcess

pytestmark = pytest.mark.single_node  # its own redis-server

PASSWORDS = {role: f"{role}-secret" for role in acl.ROLES}
TENANT = "acl-team"
SLOW_STEPS = {"PAGEDQ_FAULT_STEP_DELAY_S": "0.01"}  # a 400-token request is still running when cancelled


def pagedq_acl(*args: str) -> str:
    """What `pagedq acl` prints, with every role's password in its environment variable."""
    env = {**os.environ, **{acl.PASSWORD_ENV[r]: pw for r, pw in PASSWORDS.items()}}
    cmd = [sys.executable, "-m", "worker.cli", "acl", *args]
    return subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, timeout=60).stdout


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A redis-server whose aclfile holds the default user (the tests' admin) and pagedq's four users."""
    folder = tmp_path_factory.mktemp("acl")
    aclfile = folder / "users.acl"
    aclfile.write_text("user default on nopass ~* &* +@all\n" + pagedq_acl("--format", "aclfile"))
    srv = RedisProcess(data_dir=folder / "data", extra_args=["--aclfile", str(aclfile)]).start()
    yield srv
    srv.cleanup()


def url_of(server, role: str) -> str:
    return f"redis://{acl.DEFAULT_USERS[role]}:{PASSWORDS[role]}@127.0.0.1:{server.port}/0"


@pytest.fixture(scope="module")
def admin(server):
    r = connect(server.url, asyncio=False, socket_timeout=10, decode_responses=True)
    yield r
    r.close()


@pytest.fixture(scope="module")
def worker(server, llama_dir, admin):
    tenants.set_quota(admin, TENANT, max_queued=100, requests_per_minute=1000, tokens_per_minute=100_000)
    w = WorkerProc(llama_dir, url_of(server, "worker"), "--max-model-len", "512", env=SLOW_STEPS).start()
    yield w
    w.stop()


def refusals(admin) -> list[dict]:
    return [dict(zip(e[::2], e[1::2], strict=True)) for e in admin.execute_command("ACL", "LOG") if e]


def test_pagedq_acl_writes_both_formats():
    lines = pagedq_acl("--role", "producer", "--format", "setuser").splitlines()
    assert len(lines) == 1 and lines[0].startswith("ACL SETUSER pagedq-producer reset on #")
    assert '"(+evalsha ~pagedq:{*}:requests* ' in lines[0]  # quoted for redis-cli
    aclfile = pagedq_acl("--role", "worker", "--user", "worker=w", "--format", "aclfile")
    assert aclfile.startswith("user w reset on #") and "(+xadd ~pagedq:{*}:dead)" in aclfile
    assert PASSWORDS["worker"] not in aclfile  # only its SHA-256


async def test_every_role_works_under_its_own_user(server, admin, worker, tmp_path, capsys):
    admin.execute_command("ACL", "LOG", "RESET")
    admin.script_flush()  # the producer loads the enqueue step itself (SCRIPT LOAD)
    t0 = time.monotonic()

    # the SDK as producer: submit, stream two at once (the wake stream), cancel, re-attach, stats
    async with AsyncClient(url_of(server, "producer"), tenant=TENANT) as client:

        async def count(handle) -> int:
            return sum([len(c.token_ids) async for c in handle.stream(timeout=60)])

        first = [await client.submit(f"two readers {i}", max_tokens=4, ignore_eos=True) for i in range(2)]
        reading = asyncio.create_task(count(first[0]))
        await asyncio.sleep(0.1)
        assert [await count(first[1]), await reading] == [4, 4]
        done = await client.generate("whole", max_tokens=3, ignore_eos=True, timeout=60)
        assert len(done.token_ids) == 3
        assert (await client.handle(done.request_id).result(timeout=60)).token_ids == done.token_ids
        long = await client.submit("long", max_tokens=400, ignore_eos=True)
        async for _ in long.stream(timeout=60):
            await client.cancel(long.request_id)
            break
        with pytest.raises(Cancelled):
            await long.result(timeout=60)
        many = await client.submit_many(["a", "b"], max_tokens=2, ignore_eos=True)
        assert [len((await h.result(timeout=60)).token_ids) for h in many] == [2, 2]
        admin.zadd(keys.heartbeats("default"), {"gone-worker": int(time.time() * 1000) - 60_000})
        stats = await client.queue_stats()
        assert [w.worker for w in stats.workers] == ["w1"]
        assert admin.zscore(keys.heartbeats("default"), "gone-worker") is None  # pruned by the producer
        assert [m.name for m in await client.served_models()] == ["default"]
    with Client(url_of(server, "producer"), tenant=TENANT) as sync:
        assert len(sync.generate("sync", max_tokens=2, ignore_eos=True, timeout=60).token_ids) == 2
    producer_s = time.monotonic() - t0

    # the gateway: a chat completion (whole and streamed), a background response, a small batch
    key_file = tmp_path / "keys.json"
    key_file.write_text(json.dumps({"sk-acl": {"tenant": TENANT}}))
    gateway = GatewayProc(url_of(server, "gateway"), "--api-keys", str(key_file), "--batch-lease", "2").start()
    try:
        oai = openai.OpenAI(base_url=gateway.base_url, api_key="sk-acl", max_retries=0)
        chat = dict(model="default", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0)
        assert oai.chat.completions.create(**chat).usage.completion_tokens == 4
        assert len(list(oai.chat.completions.create(**chat, stream=True))) >= 2
        bg = oai.responses.create(model="default", input="Write a story.", background=True, max_output_tokens=8)
        done_bg = lambda: oai.responses.retrieve(bg.id).status in ("completed", "incomplete")
        wait_until(done_bg, 60, "the background response")
        assert oai.responses.retrieve(bg.id).usage.output_tokens == 8
        rows = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": chat} for i in range(2)]
        data = b"".join(json.dumps(r).encode() + b"\n" for r in rows)
        upload = oai.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
        batch = oai.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
        finished = wait_until(
            lambda: (b := oai.batches.retrieve(batch.id)).status in ("completed", "failed") and b, 60, "the batch"
        )
        assert finished.status == "completed" and finished.request_counts.completed == 2
        out = [json.loads(x) for x in oai.files.content(finished.output_file_id).content.splitlines()]
        assert sorted(o["custom_id"] for o in out) == ["c0", "c1"]
        assert [f.id for f in oai.files.list()] and oai.batches.list().data
        assert "NOPERM" not in gateway.log()
    finally:
        gateway.stop()

    # the operator: `pagedq stats`, `pagedq tenant show`, and the lanes' group and pending entries
    from worker.cli import main

    capsys.readouterr()
    admin.zadd(keys.heartbeats("default"), {"gone-worker": int(time.time() * 1000) - 60_000})  # left alone
    assert main(["stats", "--redis-url", url_of(server, "operator"), "--json", "--all-models"]) == 0
    assert json.loads(capsys.readouterr().out)["workers"][0]["worker"] == "w1"
    assert main(["tenant", "show", "--redis-url", url_of(server, "operator"), "--json"]) == 0
    assert TENANT in capsys.readouterr().out
    op = connect(url_of(server, "operator"), asyncio=False, socket_timeout=10)
    lane = keys.lane_stream("default")
    assert op.xlen(lane) == 0 and op.xinfo_groups(lane) and op.xpending(lane, keys.group("default"))
    assert op.xlen(keys.dead_letters("default")) == 0 and op.info("memory")
    op.close()

    # the one refusal: `pagedq stats` may not prune a gone worker's heartbeat as the operator, and goes on
    refused_to = [(e["username"], e["object"]) for e in refusals(admin)]
    assert refused_to == [(acl.DEFAULT_USERS["operator"], "zrem")], refusals(admin)
    assert "NOPERM" not in worker.log()
    print(f"producer part {producer_s:.1f} s, all {time.monotonic() - t0:.1f} s")


def refused(call, *args) -> None:
    with pytest.raises(redis.exceptions.NoPermissionError):
        call(*args)


def test_a_producer_cannot_touch_lanes_group_streams_or_leases(server, admin, worker):
    model = "default"
    with Client(url_of(server, "producer"), tenant=TENANT) as client:
        handle = client.submit("mine", max_tokens=2, ignore_eos=True)
        handle.result(timeout=60)
    rid, lane, group = handle.request_id, keys.lane_stream(model), keys.group(model)
    entry = admin.xadd(lane, {"id": "not-a-request", "d": b""})  # an entry to aim at (the worker drops it)
    p = connect(url_of(server, "producer"), asyncio=False, socket_timeout=10)
    try:
        refused(p.xdel, lane, entry)
        refused(p.xtrim, lane, 0)
        refused(p.delete, lane)
        refused(p.xadd, keys.response_stream(rid), {"e": b"forged", "s": 99})
        refused(p.xadd, keys.dead_letters(model), {"x": 1})
        refused(p.xack, lane, group, entry)
        refused(p.xclaim, lane, group, "mallory", 0, [entry])
        refused(p.xautoclaim, lane, group, "mallory", 0)
        refused(p.xreadgroup, group, "mallory", {lane: ">"})
        refused(p.xgroup_destroy, lane, group)
        refused(p.xgroup_createconsumer, lane, group, "mallory")
        refused(p.xgroup_setid, lane, group, "$")
        refused(p.delete, keys.lease(rid))
        refused(p.hset, keys.lease(rid), "o", "mallory")
        refused(p.delete, keys.response_stream(rid))
        refused(p.hset, keys.config(model), "max_queue_len", 1)
        refused(p.zadd, keys.models(), {"fake": 1})
        refused(p.hset, keys.tenant_quota(TENANT), "max_queued", 0)
        refused(p.keys, "pagedq:*")
        refused(p.scan, 0)
        refused(p.flushall)
        refused(p.client_list)
        refused(p.execute_command, "CLIENT", "KILL", "SKIPME", "yes")
        # the publish step from a producer: EVALSHA needs write access to the response stream and lease
        ks, args = scripts.publish_call(
            rid, owner="x", epoch="1-0:1", cap=0, live_ttl_ms=1000, result_ttl_ms=1000, first_seq=0,
            events=[b"forged"], final=True,
        )  # fmt: skip
        refused(steps.PUBLISH.run_sync, p, ks, args)
        assert p.xrange(keys.response_stream(rid))  # what it may: read a response stream
    finally:
        p.close()
    wait_until(lambda: admin.xlen(keys.dead_letters(model)) >= 1, 30, "the worker to dead-letter the entry")


def test_an_operator_can_only_read(server, admin, worker):
    model, lane = "default", keys.lane_stream("default")
    op = connect(url_of(server, "operator"), asyncio=False, socket_timeout=10)
    try:
        refused(op.set, "pagedq:anything", 1)
        refused(op.xadd, lane, {"id": "x", "d": b""})
        refused(op.xtrim, lane, 0)
        refused(op.xgroup_destroy, lane, keys.group(model))
        refused(op.xrange, lane)  # queued prompts are not stats
        refused(op.hset, keys.config(model), "max_queue_len", 1)
        refused(op.zrem, keys.heartbeats(model), "w1")
        refused(op.delete, keys.dead_letters(model))
        refused(op.hset, keys.tenant_quota(TENANT), "max_queued", 1)
        refused(op.publish, keys.control_channel(model), b"x")
        refused(op.script_load, "return 1")
        refused(op.flushall)
        refused(op.config_set, "maxmemory", "1")
        ks, args = scripts.enqueue_call(model, "normal", "op-req", b"x", None, 1000, TENANT)
        refused(steps.ENQUEUE.run_sync, op, ks, args)
        assert op.hgetall(keys.config(model)) and op.smembers(keys.tenants())
    finally:
        op.close()


def test_a_tenants_own_producer_user(server, admin, worker, llama_dir):
    """`--model-name M --tenant T`: a user for one tenant that has a model name of its own."""
    name = tenant = "acl-solo"
    rules = acl.rules("producer", "solo-pw", models=[name], tenant=tenant)
    admin.execute_command("ACL", "SETUSER", "solo", *rules)
    url = f"redis://solo:solo-pw@127.0.0.1:{server.port}/0"
    w = WorkerProc(llama_dir, url_of(server, "worker"), model=name, name="w-solo", metrics=False).start()
    try:
        with Client(url, model=name, tenant=tenant) as mine:
            assert len(mine.generate("mine", max_tokens=3, ignore_eos=True, timeout=60).token_ids) == 3
        with Client(url, model=name, tenant="someone-else") as other, pytest.raises(PermissionDenied):
            other.submit("as another tenant", max_tokens=2)  # its quota and windows are not this user's
        with Client(url, model="default", tenant=tenant, check_model=False) as other, pytest.raises(PermissionDenied):
            other.submit("into another model's queue", max_tokens=2)
    finally:
        w.stop()
        admin.execute_command("ACL", "DELUSER", "solo")


def test_what_acls_cannot_stop(server, admin, worker):
    """acl.LIMITS, shown: the producer's XADD on a lane takes any fields and trims (MAXLEN)."""
    lane = keys.lane_stream("default")
    p = connect(url_of(server, "producer"), asyncio=False, socket_timeout=10)
    try:
        before = admin.xlen(keys.dead_letters("default"))
        p.xadd(lane, {"id": "raw", "t": "someone-else", "d": b"\x00not msgpack"})  # no enqueue step
        wait_until(lambda: admin.xlen(keys.dead_letters("default")) > before, 30, "the dead letter")
        idle = keys.lane_stream("nobody-serves-this")  # entries no worker takes
        for i in range(3):
            admin.xadd(idle, {"id": f"queued-{i}", "d": b""})
        refused(p.xtrim, idle, 0)
        p.xadd(idle, {"id": "trim", "d": b""}, maxlen=0)  # XTRIM is refused, XADD ... MAXLEN 0 is not
        assert admin.xlen(idle) == 0
    finally:
        p.close()


def test_the_worker_hands_over_and_leaves_without_a_refusal(server, admin, worker):
    """Last: SIGTERM with a request running (hand-over, heartbeat and state removed) as the worker user;
    the dead letters of the tests above were written too, and Redis refused the worker nothing."""
    with Client(url_of(server, "producer"), tenant=TENANT) as client:
        long = client.submit("running at the stop", max_tokens=400, ignore_eos=True)
        next(iter(long.stream(timeout=60)))
        worker.stop()
    assert not admin.exists(keys.worker_state("default", "w1"))
    assert [e for e in refusals(admin) if e["username"] == acl.DEFAULT_USERS["worker"]] == []
    assert "NOPERM" not in worker.log() and "dead-lettered" in worker.log()
