"""The contract's Lua steps, run directly against a real redis-server."""

from __future__ import annotations

import msgspec
import pytest

from producer_sdk.contract import keys, scripts, steps
from producer_sdk.contract.connection import connect
from producer_sdk.protocol import Error, Finished, Started, Tokens, decode_event, encode_event

MODEL = "m"
GROUP = keys.group(MODEL)
RID = "req-contract-0001"


@pytest.fixture
def r(redis_url):
    client = connect(redis_url, asyncio=False, socket_timeout=10)
    for lane in keys.LANES:
        client.xgroup_create(keys.lane_stream(MODEL, lane), GROUP, id="0", mkstream=True)
    yield client
    client.close()


def _entry(r, consumer="w1", rid=RID, lane="normal", tenant="default") -> str:
    r.xadd(keys.lane_stream(MODEL, lane), {"id": rid, "t": tenant, "d": b"payload"})
    got = r.xreadgroup(GROUP, consumer, {keys.lane_stream(MODEL, lane): ">"}, count=1)
    return got[0][1][0][0].decode()


def _acquire(r, entry_id, deliveries=1, owner="w1", rid=RID) -> scripts.AcquireReply:
    epoch = scripts.lease_epoch(entry_id, deliveries)
    ks, args = scripts.acquire_call(rid, owner=owner, epoch=epoch, ttl_ms=60_000)
    return scripts.read_acquire(steps.ACQUIRE.run_sync(r, ks, args))


def _publish(r, entry_id, first_seq, events, *, final=False, owner="w1", deliveries=1, cap=0):
    ks, args = scripts.publish_call(
        RID,
        owner=owner,
        epoch=scripts.lease_epoch(entry_id, deliveries),
        cap=cap,
        live_ttl_ms=60_000,
        result_ttl_ms=5_000,
        first_seq=first_seq,
        events=[encode_event(e) for e in events],
        final=final,
    )
    return scripts.read_publish(steps.PUBLISH.run_sync(r, ks, args))


def _ack(r, entry_id, *, letter=None, tenant="default", tokens=0) -> bool:
    ks, args = scripts.ack_call(
        MODEL,
        "normal",
        RID,
        group=GROUP,
        entry_id=entry_id,
        result_ttl_ms=5_000,
        tenant=tenant,
        tokens=tokens,
        dead_letter=letter,
        now_ms=1_000_000,
    )
    return scripts.read_ack(steps.ACK.run_sync(r, ks, args))


def _stored(r):
    out = []
    for _, fields in r.xrange(keys.response_stream(RID)):
        ev = decode_event(fields[keys.EVENT_FIELD.encode()])
        assert int(fields[keys.EVENT_SEQ_FIELD.encode()]) == ev.seq
        out.append(ev)
    return out


def _tokens(seq, ids):
    return Tokens(seq=seq, token_ids=ids, text="x" * len(ids))


def test_the_same_batch_sent_twice_is_written_once(r):
    entry = _entry(r)
    assert _acquire(r, entry).ok
    batch = [Started(seq=0, worker="w1"), _tokens(1, [5, 6])]
    assert _publish(r, entry, 0, batch) == scripts.PublishReply("ok", 1)
    assert _publish(r, entry, 0, batch) == scripts.PublishReply("ok", 1)  # a retry after a lost reply
    assert [e.seq for e in _stored(r)] == [0, 1]
    # A batch that overlaps what is stored writes only its new part.
    assert _publish(r, entry, 1, [_tokens(1, [5, 6]), _tokens(2, [7])]).last_seq == 2
    assert [e.seq for e in _stored(r)] == [0, 1, 2]
    for key in (keys.response_stream(RID), keys.lease(RID)):
        assert 5_000 < r.pttl(key) <= 60_000  # the live TTL while the request runs


def test_a_gap_is_refused_and_nothing_written(r):
    entry = _entry(r)
    _acquire(r, entry)
    _publish(r, entry, 0, [Started(seq=0, worker="w1")])
    assert _publish(r, entry, 2, [_tokens(2, [1])]) == scripts.PublishReply("gap", 0)
    assert [e.seq for e in _stored(r)] == [0]


def test_final_event_then_ack_once(r):
    entry = _entry(r, tenant="team-a")
    _acquire(r, entry)
    r.set(keys.submitted_marker(MODEL, RID), 1, px=86_400_000)
    r.hset(keys.tenant_queued(MODEL), "team-a", 1)
    fin = Finished(seq=1, finish_reason="stop")
    assert _publish(r, entry, 0, [Started(seq=0, worker="w1"), fin], final=True).status == "ok"
    for key in (keys.response_stream(RID), keys.lease(RID)):
        assert 0 < r.pttl(key) <= 5_000  # the result TTL starts at the final event
    assert _publish(r, entry, 0, [Started(seq=0, worker="w1"), fin], final=True).status == "ok"  # a retry
    lane = keys.lane_stream(MODEL, "normal")
    assert r.xpending(lane, GROUP)["pending"] == 1  # not acked by the publish step
    assert _ack(r, entry, tenant="team-a", tokens=40) is True
    assert r.xpending(lane, GROUP)["pending"] == 0 and r.xlen(lane) == 0
    assert 0 < r.pttl(keys.submitted_marker(MODEL, RID)) <= 5_000  # a resubmit after that runs anew
    assert r.hget(keys.tenant_queued(MODEL), "team-a") is None
    assert r.hget(keys.tenant_tokens(MODEL, "team-a"), "n") == b"40"
    # The retried ack (its reply lost) changes nothing: no second count, no second decrement.
    r.hset(keys.tenant_queued(MODEL), "team-a", 5)
    assert _ack(r, entry, tenant="team-a", tokens=40) is False
    assert r.hget(keys.tenant_queued(MODEL), "team-a") == b"5"
    assert r.hget(keys.tenant_tokens(MODEL, "team-a"), "n") == b"40"
    assert [type(e) for e in _stored(r)] == [Started, Finished]


def test_tokens_count_only_for_the_entrys_own_tenant(r):
    entry = _entry(r, tenant="team-a")
    assert _ack(r, entry, tenant="team-b", tokens=40) is True
    assert not r.exists(keys.tenant_tokens(MODEL, "team-b")) and not r.exists(keys.tenant_tokens(MODEL, "team-a"))


def test_a_later_delivery_fences_the_earlier_attempt(r):
    entry = _entry(r, consumer="w1")
    assert _acquire(r, entry, 1, "w1").ok
    assert _publish(r, entry, 0, [Started(seq=0, worker="w1")]).status == "ok"
    # w2 reclaims the entry (its second delivery) and takes the lease before reading the stream.
    assert _acquire(r, entry, 2, "w2").ok
    assert _publish(r, entry, 1, [_tokens(1, [9])], owner="w1").status == "lost"  # w1 writes nothing now
    assert _publish(r, entry, 1, [_tokens(1, [4])], owner="w2", deliveries=2).status == "ok"
    assert [e.token_ids for e in _stored(r) if isinstance(e, Tokens)] == [[4]]
    # An older delivery cannot take it back; the holder's own retried acquire is fine.
    stale = _acquire(r, entry, 1, "w1")
    assert (stale.ok, stale.holder_epoch, stale.holder) == (False, scripts.lease_epoch(entry, 2), "w2")
    assert _acquire(r, entry, 2, "w2").ok
    assert not _acquire(r, entry, 2, "w3").ok  # the same delivery never has two owners


def test_a_newer_entry_of_the_request_wins_the_lease(r):
    old = _entry(r, consumer="w1")
    new = _entry(r, consumer="w2")  # a resubmit of the same request id (after Redis lost its marker)
    assert _acquire(r, new, 1, "w2").ok
    assert not _acquire(r, old, 5, "w1").ok  # more deliveries of an older entry do not win
    assert scripts.entry_newer(new, old) and not scripts.entry_newer(old, new)


def test_epochs_compare_as_numbers():
    a, b = "1700000000000-9", "1700000000000-10"
    assert scripts.entry_newer(b, a)  # as strings, "10" < "9"


def test_epochs_compare_as_numbers_in_the_script(r):
    assert _acquire(r, "1700000000000-10", 1, "w2").ok
    assert not _acquire(r, "1700000000000-9", 3, "w1").ok
    assert _acquire(r, "1700000000001-0", 1, "w3").ok


def test_without_its_lease_nothing_is_written(r):
    entry = _entry(r)
    assert _publish(r, entry, 0, [Started(seq=0, worker="w1")]).status == "lost"
    _acquire(r, entry)
    r.delete(keys.lease(RID))  # Redis lost it
    assert _publish(r, entry, 0, [Started(seq=0, worker="w1")]).status == "lost"
    assert _stored(r) == []


def test_dead_letter_keeps_a_bounded_copy_written_once(r):
    entry = _entry(r)
    _acquire(r, entry)
    letter = scripts.DeadLetter(
        request_id=RID,
        code="invalid",
        reason="bad",
        lane="normal",
        entry_id=entry,
        worker="w1",
        payload_head=b"head",
        payload_len=100_000,
        payload_sha1="ab" * 20,
        min_id="0-0",
    )
    err = Error(seq=0, code="invalid", message="bad")
    assert _publish(r, entry, 0, [err], final=True).status == "ok"
    assert _ack(r, entry, letter=letter) is True
    assert _ack(r, entry, letter=letter) is False  # a retry after a lost reply
    dead = r.xrange(keys.dead_letters(MODEL))
    assert len(dead) == 1
    fields = {k.decode(): v for k, v in dead[0][1].items()}
    assert fields["payload"] == b"head" and fields["payload_len"] == b"100000" and fields["code"] == b"invalid"


def test_drop_is_fenced_on_the_entrys_owner(r):
    entry = _entry(r, consumer="w1")
    letter = scripts.DeadLetter(RID, "malformed", "bad", "normal", entry, "w2", b"", 0, "", "0-0")
    ks, args = scripts.drop_call(MODEL, "normal", group=GROUP, consumer="w2", entry_id=entry, dead_letter=letter)
    assert steps.DROP.run_sync(r, ks, args) == b"lost"
    assert r.xlen(keys.lane_stream(MODEL, "normal")) == 1 and r.xlen(keys.dead_letters(MODEL)) == 0
    ks, args = scripts.drop_call(MODEL, "normal", group=GROUP, consumer="w1", entry_id=entry, dead_letter=letter)
    assert steps.DROP.run_sync(r, ks, args) == b"ok"
    assert r.xlen(keys.lane_stream(MODEL, "normal")) == 0 and r.xlen(keys.dead_letters(MODEL)) == 1


def test_old_entries_without_seq_field_are_read_by_their_event(r):
    entry = _entry(r)
    _acquire(r, entry)
    r.xadd(keys.response_stream(RID), {"e": encode_event(Started(seq=0, worker="old"))})
    r.xadd(keys.response_stream(RID), {"e": encode_event(_tokens(1, [3]))})
    assert _publish(r, entry, 1, [_tokens(1, [3]), _tokens(2, [4])]) == scripts.PublishReply("ok", 2)
    assert len(r.xrange(keys.response_stream(RID))) == 3


def test_enqueue_caps_the_whole_model_not_each_lane(r):
    replies = []
    for i, lane in enumerate(["high", "normal", "low", "normal"]):
        ks, args = scripts.enqueue_call(MODEL, lane, f"req-cap-{i:06d}", b"p", 3, 60_000)
        replies.append(scripts.read_enqueue(steps.ENQUEUE.run_sync(r, ks, args)))
    assert [x.status for x in replies] == ["ok", "ok", "ok", "full"]
    assert (replies[-1].queued, replies[-1].limit) == (3, 3)
    # Without a limit from the SDK or a worker, the default cap applies.
    ks, args = scripts.enqueue_call(MODEL, "normal", "req-cap-default", b"p", None, 60_000)
    assert args[4] == scripts.DEFAULT_MAX_QUEUE_LEN
    assert scripts.read_enqueue(steps.ENQUEUE.run_sync(r, ks, args)).status == "ok"
    assert scripts.read_enqueue(steps.ENQUEUE.run_sync(r, ks, args)).status == "duplicate"


def test_claim_own_reports_entries_owned_by_others(r):
    mine, theirs = _entry(r, "w1", rid="req-own-000001"), _entry(r, "w2", rid="req-own-000002")
    ks, args = scripts.claim_own_call(MODEL, "normal", group=GROUP, consumer="w1", idle_ms=0, entry_ids=[mine, theirs])
    assert scripts.read_claim_own(steps.CLAIM_OWN.run_sync(r, ks, args)) == {theirs}


def test_a_step_missing_on_the_server_is_loaded(r):
    r.script_flush()  # as after a restart, or on a replica just promoted
    entry = _entry(r)
    assert _acquire(r, entry).ok  # run alone: loaded and sent again
    r.script_flush()
    calls = [
        (
            steps.PUBLISH,
            *scripts.publish_call(
                RID,
                owner="w1",
                epoch=scripts.lease_epoch(entry, 1),
                cap=0,
                live_ttl_ms=60_000,
                result_ttl_ms=5_000,
                first_seq=0,
                events=[encode_event(Started(seq=0, worker="w1"))],
                final=False,
            ),
        ),
        steps.Cmd("XLEN", keys.response_stream(RID)),
    ]
    replies = steps.run_many_sync(r, calls, resend_all=True)
    assert scripts.read_publish(replies[0]).status == "ok" and replies[1] == 1


def test_unknown_event_types_decode_as_unknown():
    from producer_sdk.protocol import UnknownEvent

    data = msgspec.msgpack.encode({"type": "tool_call_delta", "seq": 7, "whatever": [1, 2]})
    assert decode_event(data) == UnknownEvent(seq=7, type="tool_call_delta")
