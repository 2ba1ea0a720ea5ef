"""Fair share between tenants with a real redis-server and real worker processes: a tenant behind a
flood is admitted before the flood drains (and is not with --fair-share-window 0), held entries are
renewed while healthy, answered at once when cancelled, and handed over on shutdown."""

from __future__ import annotations

import asyncio
import itertools
import signal
import time

import pytest

from producer_sdk import Client, tenants
from producer_sdk.contract import keys
from producer_sdk.contract.connection import connect
from producer_sdk.protocol import Finished, Started
from tests.service.worker_proc import WorkerProc, response_events, wait_until

WINDOW = 8
ONE_SEAT = ("--max-num-seqs", "1", "--max-model-len", "512")  # + headroom 1: two admitted at a time


def flood_then_calm(redis_url: str, flood: int, calm: int, max_tokens: int = 4) -> tuple[list[str], list[str]]:
    """Tenant `flood` enqueues `flood` requests, then tenant `calm` enqueues `calm` (no worker yet)."""
    req = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    with Client(redis_url) as client:
        a = client.submit_many([{"prompt": f"flood {i}", **req} for i in range(flood)], tenant="flood")
        b = client.submit_many([{"prompt": f"calm {i}", **req} for i in range(calm)], tenant="calm")
    return [h.request_id for h in a], [h.request_id for h in b]


def admitted(w: WorkerProc) -> list[tuple[str, str]]:
    """(tenant, request id) in the order the worker admitted them (its debug log lines)."""
    return [(e["tenant"], e["request_id"]) for e in w.log_events() if e.get("event") == "request admitted"]


def finish_all(redis_url: str, ids: list[str], timeout: float = 120) -> None:
    with Client(redis_url) as client:
        for rid in ids:
            client.handle(rid).result(timeout=timeout)


@pytest.mark.parametrize("window", [WINDOW, 0])
def test_a_flood_cannot_starve_a_tenant_behind_it(llama_dir, redis_url, window):
    flood, calm = flood_then_calm(redis_url, 30, 3)
    w = WorkerProc(llama_dir, redis_url, *ONE_SEAT, "--fair-share-window", str(window), "--log-level", "DEBUG")
    w.start()
    try:
        finish_all(redis_url, flood + calm)
        order = admitted(w)
    finally:
        w.stop()
    assert sorted(rid for _, rid in order) == sorted(flood + calm)
    assert [rid for t, rid in order if t == "flood"] == flood  # FIFO within a tenant
    assert [rid for t, rid in order if t == "calm"] == calm
    tenants_in_order = [t for t, _ in order]
    calm_at = [i for i, t in enumerate(tenants_in_order) if t == "calm"]
    if window == 0:
        # FIFO: calm waits for the whole flood queued before it
        assert calm_at == [30, 31, 32], tenants_in_order
        return
    # Calm's requests are seen once the flood left in the stream fits the window, and from then on
    # they alternate with the flood's: each is admitted before most of the flood's held entries.
    flood_after_last_calm = len(tenants_in_order) - 1 - calm_at[-1]
    assert flood_after_last_calm >= WINDOW - 3, tenants_in_order
    assert all(b - a <= 2 for a, b in itertools.pairwise(calm_at)), tenants_in_order
    assert calm_at[0] <= 30 - WINDOW + 1, tenants_in_order


def test_weights_give_shares(llama_dir, redis_url):
    """Two tenants both backlogged inside the window: weight 3 gets three admissions for one."""
    r = connect(redis_url, asyncio=False, socket_timeout=10)
    tenants.set_weight(r, "heavy", 3)
    assert tenants.get_weight(r, "heavy") == 3.0 and tenants.get_weight(r, "light") == 1.0
    r.close()
    req = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    with Client(redis_url) as client:
        items = [{"prompt": f"x {i}", "tenant": "light" if i % 2 else "heavy", **req} for i in range(40)]
        ids = [h.request_id for h in client.submit_many(items)]
    w = WorkerProc(llama_dir, redis_url, *ONE_SEAT, "--fair-share-window", "40", "--log-level", "DEBUG").start()
    try:
        finish_all(redis_url, ids)
        order = [t for t, _ in admitted(w)]
    finally:
        w.stop()
    # The first admission is read alone (nothing is known of request sizes yet); after it the window
    # holds the rest, and the first 20 picks from it go 3:1 (heavy runs out after its 20).
    picks = order[1:21]
    assert 14 <= picks.count("heavy") <= 16, order


def test_held_entries_are_renewed_cancelled_and_handed_over(llama_dir, redis_url):
    flood, _ = flood_then_calm(redis_url, 20, 0, max_tokens=400)
    # Idle timeout 1 s: an entry held longer without renewal would be any worker's to claim.
    w1 = WorkerProc(
        llama_dir, redis_url, *ONE_SEAT, "--claim-idle-ms", "1000", "--fair-share-window", str(WINDOW), name="w1"
    )
    w1.start()
    try:
        wait_until(lambda: w1.metric("pagedq_fair_share_held_entries", tenant="flood") == WINDOW, what="held")
        # Cancel the last request read: held, it is answered now, not after the ones before it.
        with Client(redis_url) as client:
            client.cancel(flood[WINDOW + 1])
        events = wait_until(lambda: response_events(redis_url, flood[WINDOW + 1]), what="the abort")
        assert [type(e) for e in events] == [Finished] and events[0].finish_reason == "abort"
        assert not response_events(redis_url, flood[WINDOW])  # read before it, still held

        # While w1 lives, what it holds is renewed: never idle as long as the claim timeout.
        r = connect(redis_url, asyncio=False, socket_timeout=10)
        stream, group = keys.lane_stream("default"), keys.group("default")
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            pending = r.xpending_range(stream, group, min="-", max="+", count=100, consumername="w1")
            assert len(pending) >= 2 and all(p["time_since_delivered"] < 1000 for p in pending), pending
            assert all(p["times_delivered"] == 1 for p in pending), pending
            time.sleep(0.1)
        assert w1.metric("pagedq_fair_share_held_entries") > 0  # still holding after 2 s

        # Another worker took a held entry (as after a stall past the timeout): w1 lets it go.
        # (the one read last, so admitted last: FIFO within the tenant)
        ids = [p["message_id"] for p in r.xpending_range(stream, group, "-", "+", 100, consumername="w1")]
        stolen = max(ids, key=lambda i: tuple(int(x) for x in i.split(b"-")))
        assert r.xclaim(stream, group, "thief", 0, [stolen], justid=True) == [stolen]
        lost = wait_until(lambda: [e for e in w1.log_events() if "owned by another worker" in e.get("event", "")])
        # w1's renewal found it gone and let it go (the gauge is no proof: w1 may read another entry to
        # hold in its place at once); the entry stays the thief's
        assert lost[0]["count"] == 1
        assert r.xpending_range(stream, group, stolen, stolen, 1)[0]["consumer"] == b"thief"
        r.xclaim(stream, group, "thief", 0, [stolen], idle=10**12, justid=True)  # the thief lets it go
        r.close()

        # Shutdown: held entries are released at once, running ones finish first (drain).
        w1.signal(signal.SIGTERM)
        assert w1.wait(60) == 0
        handed = [e for e in w1.log_events() if e.get("event") == "handing over held entries"]
        assert handed and handed[0]["count"] > 0
    finally:
        w1.stop()
    # A worker with a 60 s idle timeout takes them at once: they were released, not left to time out.
    # (with seats for all of them: the rest run side by side)
    w2 = WorkerProc(llama_dir, redis_url, "--max-model-len", "512", "--claim-idle-ms", "60000", name="w2").start()
    try:
        rest = [rid for rid in flood if rid != flood[WINDOW + 1]]
        finish_all(redis_url, rest, timeout=50)
        # (the stolen entry, idle with its thief, is reclaimed by w1 or by w2)
        assert handed[0]["count"] <= w2.metric("pagedq_requests_reclaimed_total") <= handed[0]["count"] + 1
    finally:
        w2.stop()
    starts = {rid: [e for e in response_events(redis_url, rid) if isinstance(e, Started)] for rid in rest}
    assert all(len(s) == 1 for s in starts.values()), starts  # each ran once: none lost, none run twice
    assert sum(s[0].worker == "w2" for s in starts.values()) >= handed[0]["count"]


def test_weight_command_and_the_workers_cache(redis_url, capsys):
    from worker.cli import main as pagedq
    from worker.service.tenant_weights import TenantWeights

    url = ["--redis-url", redis_url]
    r = connect(redis_url, asyncio=False, socket_timeout=10)
    assert pagedq(["tenant", "set", "team-a", "--weight", "2.5", *url]) == 0
    assert "fair-share weight 2.5" in capsys.readouterr().out
    assert tenants.get_weight(r, "team-a") == 2.5
    assert pagedq(["tenant", "set", "team-a", "--max-queued", "3", *url]) == 0  # the weight is kept
    assert tenants.get_weight(r, "team-a") == 2.5
    # a bad weight is refused before anything is written (the quota change with it too)
    for bad in ("0", "-1", "nan", "inf"):
        assert pagedq(["tenant", "set", "team-a", "--weight", bad, "--max-queued", "9", *url]) == 1
    assert tenants.get_quota(r, "team-a").max_queued == 3 and tenants.get_weight(r, "team-a") == 2.5
    r.hset(keys.tenant_quota("team-b"), tenants.WEIGHT_FIELD, "junk")  # set by hand: read as the default
    assert tenants.get_weight(r, "team-b") == tenants.DEFAULT_WEIGHT

    async def cached() -> None:
        aio = connect(redis_url, asyncio=True, socket_timeout=10)
        try:
            weights = TenantWeights(aio, ttl_s=3600)
            await weights.refresh(["team-a", "team-c"])
            assert (weights.get("team-a"), weights.get("team-c")) == (2.5, 1.0)
            tenants.set_weight(r, "team-a", 4)
            await weights.refresh(["team-a"])
            assert weights.get("team-a") == 2.5  # cached: not read per request
            weights.ttl_s = 0
            await weights.refresh(["team-a"])
            assert weights.get("team-a") == 4.0
        finally:
            await aio.aclose()

    asyncio.run(cached())
    assert pagedq(["tenant", "delete", "team-a", *url]) == 0  # the weight goes with the quota
    assert tenants.get_weight(r, "team-a") == tenants.DEFAULT_WEIGHT
    r.close()
