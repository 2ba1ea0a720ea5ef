"""`pagedq migrate`: a single node with the layout before hash tags (keys written by hand, as the
previous version wrote them) is moved to today's layout, and a new worker then serves what was
queued, resumes what was running and leaves what was finished readable."""

from __future__ import annotations

import pytest

from producer_sdk import Client
from producer_sdk.contract import keys
from producer_sdk.contract.connection import connect
from producer_sdk.protocol import (
    Finished,
    GenerateRequest,
    SamplingParams,
    Started,
    Tokens,
    encode_event,
)
from producer_sdk.request_codec import encode_request
from tests.service.worker_proc import WorkerProc, response_events, wait_until
from worker.cli import main as pagedq

pytestmark = pytest.mark.single_node  # the old layout never ran on a cluster

OLD = "pagedq:default:"
GROUP = "pagedq:default:workers"


def _request(rid: str, max_tokens: int) -> bytes:
    req = GenerateRequest(
        v=1,
        request_id=rid,
        prompt_token_ids=[5, 6, 7, 8],
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0),
    )
    return encode_request(req)


def _old_event(r, rid: str, ev) -> None:
    r.xadd(f"pagedq:resp:{rid}", {"e": encode_event(ev), "s": ev.seq})


@pytest.fixture
def old_layout(redis_url):
    """What the previous version left: one request queued, one running when its worker was stopped
    (pending, two tokens streamed), one finished, their markers, a config, a heartbeat, a tenant's
    count and its cross-model rate window."""
    r = connect(redis_url, asyncio=False, socket_timeout=10)
    lane = f"{OLD}requests"
    r.xgroup_create(lane, GROUP, id="0", mkstream=True)
    r.xadd(lane, {"id": "old-running-1", "t": "team-a", "d": _request("old-running-1", 6)})
    r.xreadgroup(GROUP, "old-worker", {lane: ">"}, count=1)  # pending to a worker that is gone
    _old_event(r, "old-running-1", Started(seq=0, worker="old-worker"))
    _old_event(r, "old-running-1", Tokens(seq=1, token_ids=[11, 12], text="ab"))
    r.xadd(lane, {"id": "old-queued-01", "t": "team-a", "d": _request("old-queued-01", 3)})
    _old_event(r, "old-finished1", Started(seq=0, worker="old-worker"))
    _old_event(r, "old-finished1", Finished(seq=1, finish_reason="stop"))
    r.pexpire("pagedq:resp:old-finished1", 600_000)
    for rid in ("old-running-1", "old-queued-01", "old-finished1"):
        r.set(f"pagedq:req:{rid}", 1, px=3_600_000)
    r.hset(f"{OLD}config", mapping={"max_queue_len": 50, "max_model_len": 256})
    r.hset(f"{OLD}tenant_queued", "team-a", 2)
    r.zadd(f"{OLD}heartbeats", {"old-worker": 1})
    r.set(f"{OLD}worker:old-worker", "{}")
    r.hset("pagedq:tenant:team-a:rate", mapping={"w": 1, "n": 3})
    r.hset("pagedq:tenant:team-a:quota", "max_queued", 10)
    yield r
    r.close()


def test_migrate_moves_the_old_layout_and_a_new_worker_serves_it(llama_dir, redis_url, old_layout, capsys):
    r = old_layout
    assert pagedq(["migrate", "--dry-run", "--redis-url", redis_url]) == 0
    assert "would rename pagedq:default:requests -> pagedq:{default}:requests" in capsys.readouterr().out
    assert r.exists(f"{OLD}requests")  # a dry run changes nothing

    assert pagedq(["migrate", "--redis-url", redis_url]) == 0
    out = capsys.readouterr().out
    assert "renamed pagedq:resp:old-running-1 -> pagedq:resp:{old-running-1}" in out
    assert not r.keys("pagedq:default:*") and not r.keys("pagedq:req:*") and not r.exists("pagedq:resp:old-finished1")
    assert r.xlen(keys.lane_stream("default")) == 2
    assert r.xpending(keys.lane_stream("default"), GROUP)["pending"] == 1  # the group came along
    assert r.hget(keys.config("default"), "max_queue_len") == b"50"
    assert r.hget(keys.tenant_queued("default"), "team-a") == b"2"
    assert 0 < r.pttl(keys.submitted_marker("default", "old-queued-01")) <= 3_600_000  # its TTL kept
    assert 0 < r.pttl(keys.response_stream("old-finished1")) <= 600_000
    assert not r.exists("pagedq:tenant:team-a:rate") and r.hget(keys.tenant_quota("team-a"), "max_queued") == b"10"
    assert not r.exists(f"{OLD}heartbeats")

    assert pagedq(["migrate", "--redis-url", redis_url]) == 0  # a second run moves nothing
    assert "0 keys renamed, 0 deleted" in capsys.readouterr().out

    w = WorkerProc(llama_dir, redis_url, "--claim-idle-ms", "1000", metrics=False).start()
    try:
        with Client(redis_url) as client:
            queued = client.handle("old-queued-01").result(timeout=60)
            assert queued.finish_reason == "length" and len(queued.token_ids) == 3
            resumed = client.handle("old-running-1").result(timeout=60)
            assert resumed.token_ids[:2] == [11, 12] and len(resumed.token_ids) == 6  # resumed, not restarted
            assert client.handle("old-finished1").result(timeout=10).finish_reason == "stop"
        starts = [e for e in response_events(redis_url, "old-running-1") if isinstance(e, Started)]
        assert [s.worker for s in starts] == ["old-worker", "w1"] and starts[1].attempt == 2
        wait_until(lambda: r.xlen(keys.lane_stream("default")) == 0, 30, "both entries acked")
        assert not r.hget(keys.tenant_queued("default"), "team-a")
    finally:
        w.stop()
