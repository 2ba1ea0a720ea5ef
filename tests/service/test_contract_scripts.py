"""The contract's Lua steps, run directly against a real redis-server."""

from __future__ import annotations

import msgspec
import pytest
import redis

from producer_sdk.contract import keys, scripts
from producer_sdk.protocol import Finished, Started, Tokens, decode_event, encode_event

MODEL = "m"
GROUP = keys.group(MODEL)
RID = "req-contract-0001"


@pytest.fixture
def r(redis_url):
    client = redis.Redis.from_url(redis_url)
    for lane in keys.LANES:
        client.xgroup_create(keys.lane_stream(MODEL, lane), GROUP, id="0", mkstream=True)
    yield client
    client.close()


def _entry(r, consumer="w1", rid=RID, lane="normal") -> str:
    r.xadd(keys.lane_stream(MODEL, lane), {"id": rid, "d": b"payload"})
    got = r.xreadgroup(GROUP, consumer, {keys.lane_stream(MODEL, lane): ">"}, count=1)
    return got[0][1][0][0].decode()


def _publish(r, entry_id, first_seq, events, *, final=False, consumer="w1", letter=None, cap=0):
    ks, args = scripts.publish_call(
        MODEL,
        "normal",
        RID,
        group=GROUP,
        consumer=consumer,
        entry_id=entry_id,
        cap=cap,
        live_ttl_ms=60_000,
        result_ttl_ms=5_000,
        first_seq=first_seq,
        events=[encode_event(e) for e in events],
        final=final,
        dead_letter=letter,
    )
    return scripts.read_publish(r.register_script(scripts.PUBLISH)(keys=ks, args=args))


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
    batch = [Started(seq=0, worker="w1"), _tokens(1, [5, 6])]
    assert _publish(r, entry, 0, batch) == scripts.PublishReply("ok", 1)
    assert _publish(r, entry, 0, batch) == scripts.PublishReply("ok", 1)  # a retry after a lost reply
    assert [e.seq for e in _stored(r)] == [0, 1]
    # A batch that overlaps what is stored writes only its new part.
    assert _publish(r, entry, 1, [_tokens(1, [5, 6]), _tokens(2, [7])]).last_seq == 2
    assert [e.seq for e in _stored(r)] == [0, 1, 2]
    ttl = r.pttl(keys.response_stream(RID))
    assert 5_000 < ttl <= 60_000  # the live TTL while the request runs


def test_a_gap_is_refused_and_nothing_written(r):
    entry = _entry(r)
    _publish(r, entry, 0, [Started(seq=0, worker="w1")])
    assert _publish(r, entry, 2, [_tokens(2, [1])]) == scripts.PublishReply("gap", 0)
    assert [e.seq for e in _stored(r)] == [0]


def test_final_batch_acks_once_and_its_retry_reports_done(r):
    entry = _entry(r)
    r.set(keys.submitted_marker(RID), 1, px=86_400_000)
    fin = Finished(seq=1, finish_reason="stop")
    assert _publish(r, entry, 0, [Started(seq=0, worker="w1"), fin], final=True).status == "ok"
    lane = keys.lane_stream(MODEL, "normal")
    assert r.xpending(lane, GROUP)["pending"] == 0 and r.xlen(lane) == 0
    assert 0 < r.pttl(keys.response_stream(RID)) <= 5_000  # the result TTL starts at the final event
    assert 0 < r.pttl(keys.submitted_marker(RID)) <= 5_000  # a resubmit after that runs anew
    assert _publish(r, entry, 0, [Started(seq=0, worker="w1"), fin], final=True).status == "done"
    assert [type(e) for e in _stored(r)] == [Started, Finished]


def test_a_worker_that_lost_the_entry_writes_nothing(r):
    entry = _entry(r, consumer="w1")
    r.xclaim(keys.lane_stream(MODEL, "normal"), GROUP, "w2", 0, [entry])
    assert _publish(r, entry, 0, [Started(seq=0, worker="w1")], consumer="w1").status == "lost"
    assert _stored(r) == []


def test_missing_group_owns_nothing(r):
    entry = _entry(r)
    r.delete(keys.lane_stream(MODEL, "normal"))  # Redis lost the lane
    assert _publish(r, entry, 0, [Started(seq=0, worker="w1")]).status == "lost"


def test_dead_letter_keeps_a_bounded_copy_written_once(r):
    entry = _entry(r)
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
    from producer_sdk.protocol import Error

    err = Error(seq=0, code="invalid", message="bad")
    assert _publish(r, entry, 0, [err], final=True, letter=letter).status == "ok"
    assert _publish(r, entry, 0, [err], final=True, letter=letter).status == "done"
    dead = r.xrange(keys.dead_letters(MODEL))
    assert len(dead) == 1
    fields = {k.decode(): v for k, v in dead[0][1].items()}
    assert fields["payload"] == b"head" and fields["payload_len"] == b"100000" and fields["code"] == b"invalid"


def test_old_entries_without_seq_field_are_read_by_their_event(r):
    entry = _entry(r)
    r.xadd(keys.response_stream(RID), {"e": encode_event(Started(seq=0, worker="old"))})
    r.xadd(keys.response_stream(RID), {"e": encode_event(_tokens(1, [3]))})
    assert _publish(r, entry, 1, [_tokens(1, [3]), _tokens(2, [4])]) == scripts.PublishReply("ok", 2)
    assert len(r.xrange(keys.response_stream(RID))) == 3


def test_enqueue_caps_the_whole_model_not_each_lane(r):
    enqueue = r.register_script(scripts.ENQUEUE)
    replies = []
    for i, lane in enumerate(["high", "normal", "low", "normal"]):
        ks, args = scripts.enqueue_call(MODEL, lane, f"req-cap-{i:06d}", b"p", 3, 60_000)
        replies.append(scripts.read_enqueue(enqueue(keys=ks, args=args)))
    assert [x.status for x in replies] == ["ok", "ok", "ok", "full"]
    assert (replies[-1].queued, replies[-1].limit) == (3, 3)
    # Without a limit from the SDK or a worker, the default cap applies.
    ks, args = scripts.enqueue_call(MODEL, "normal", "req-cap-default", b"p", None, 60_000)
    assert args[4] == scripts.DEFAULT_MAX_QUEUE_LEN
    assert scripts.read_enqueue(enqueue(keys=ks, args=args)).status == "ok"
    assert scripts.read_enqueue(enqueue(keys=ks, args=args)).status == "duplicate"


def test_claim_own_reports_entries_owned_by_others(r):
    mine, theirs = _entry(r, "w1", rid="req-own-000001"), _entry(r, "w2", rid="req-own-000002")
    ks, args = scripts.claim_own_call(MODEL, "normal", group=GROUP, consumer="w1", idle_ms=0, entry_ids=[mine, theirs])
    assert scripts.read_claim_own(r.register_script(scripts.CLAIM_OWN)(keys=ks, args=args)) == {theirs}


def test_unknown_event_types_decode_as_unknown():
    from producer_sdk.protocol import UnknownEvent

    data = msgspec.msgpack.encode({"type": "tool_call_delta", "seq": 7, "whatever": [1, 2]})
    assert decode_event(data) == UnknownEvent(seq=7, type="tool_call_delta")
