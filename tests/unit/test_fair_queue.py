"""The fair queue's order: weighted shares, no banked credit for idle tenants, FIFO within a tenant,
lanes first."""

from __future__ import annotations

import itertools
from collections import Counter

from producer_sdk.contract.keys import ENTRY_ID_FIELD, ENTRY_TENANT_FIELD, LANES
from worker.service.fair_queue import PRUNE_EVERY, FairQueue
from worker.service.inflight import Entry

_ids = itertools.count(1)


def entry(tenant: str, lane: str = "normal") -> Entry:
    n = next(_ids)
    fields = {ENTRY_TENANT_FIELD.encode(): tenant.encode(), ENTRY_ID_FIELD.encode(): f"req-{tenant}-{n:06d}".encode()}
    return Entry(lane, f"stream:{lane}", f"{n}-0", fields)


def weights(**w: float):
    return lambda t: w.get(t, 1.0)


def shares(q: FairQueue, picks: int, weight, refill: dict[str, int] | None = None) -> Counter[str]:
    """Tenants of `picks` pops, each tenant's backlog topped up so it never runs dry."""
    got = Counter[str]()
    for _ in range(picks):
        e = q.pop(weight)
        assert e is not None
        got[e.tenant] += 1
        q.push(entry(e.tenant, e.lane))
    return got


def test_equal_weights_share_equally():
    q = FairQueue(LANES)
    for t in ("a", "b"):
        for _ in range(5):
            q.push(entry(t))
    got = shares(q, 1000, weights())
    assert abs(got["a"] - 500) <= 2, got


def test_weights_three_to_one():
    q = FairQueue(LANES)
    for t in ("a", "b"):
        for _ in range(5):
            q.push(entry(t))
    got = shares(q, 1000, weights(a=3))
    assert abs(got["a"] - 750) <= 3, got
    # any window of 40 picks is within one pick of its share: no long runs of either
    q2 = FairQueue(LANES)
    q2.push(entry("a"))
    q2.push(entry("b"))
    order = []
    for _ in range(400):
        e = q2.pop(weights(a=3))
        order.append(e.tenant)
        q2.push(entry(e.tenant))
    for i in range(0, 400, 40):
        assert abs(order[i : i + 40].count("a") - 30) <= 1, order[i : i + 40]


def test_flooding_tenant_cannot_starve_a_newcomer():
    q = FairQueue(LANES)
    for _ in range(100):
        q.push(entry("flood"))
    for _ in range(30):  # flood alone for a while
        assert q.pop(weights()).tenant == "flood"
    for _ in range(3):
        q.push(entry("calm"))
    order = [q.pop(weights()).tenant for _ in range(6)]
    assert order.count("calm") == 3 and order[0] == "calm", order


def test_idle_tenant_rejoins_without_banked_credit():
    q = FairQueue(LANES)
    for _ in range(200):
        q.push(entry("a"))
    for _ in range(100):  # b idle: a gets everything
        assert q.pop(weights()).tenant == "a"
    for _ in range(100):
        q.push(entry("b"))
    order = [q.pop(weights()).tenant for _ in range(20)]
    # b rejoins at a's current virtual time: it alternates with a instead of taking 100 in a row
    assert 9 <= order.count("b") <= 11, order
    # the same for a tenant that had been served a lot, had nothing waiting, then came back
    q = FairQueue(LANES)
    for _ in range(50):
        q.push(entry("a"))
    assert [e.tenant for e in q.pop_many(50, weights())] == ["a"] * 50
    for _ in range(100):
        q.push(entry("b"))
    assert [e.tenant for e in q.pop_many(50, weights())] == ["b"] * 50  # a idle now
    for _ in range(10):
        q.push(entry("a"))
    order = [q.pop(weights()).tenant for _ in range(10)]
    assert order.count("a") == 5, order


def test_fifo_within_a_tenant():
    q = FairQueue(LANES)
    pushed = {"a": [], "b": []}
    for i in range(20):
        e = entry("a" if i % 3 else "b")
        pushed[e.tenant].append(e.entry_id)
        q.push(e)
    popped = {"a": [], "b": []}
    while (e := q.pop(weights(b=2))) is not None:
        popped[e.tenant].append(e.entry_id)
    assert popped == pushed


def test_higher_lane_first_whatever_the_virtual_time():
    q = FairQueue(LANES)
    for _ in range(10):
        q.push(entry("a", "high"))
    for _ in range(5):
        q.push(entry("b", "normal"))
    q.push(entry("c", "low"))
    order = [(e.lane, e.tenant) for e in q.pop_many(20, weights())]
    assert order == [("high", "a")] * 10 + [("normal", "b")] * 5 + [("low", "c")]
    # a's ten admissions count against it in the other lanes too: a newcomer goes first
    for _ in range(3):
        q.push(entry("a"))
        q.push(entry("d"))
    assert [e.tenant for e in q.pop_many(6, weights())] == ["d", "a"] * 3


def test_remove_and_drain():
    q = FairQueue(LANES)
    es = [entry(t) for t in ("a", "a", "b", "c")]
    for e in es:
        q.push(e)
    assert q.holds(es[1].key) and len(q) == 4
    assert q.remove_request(es[1].request_id) is es[1]
    assert q.remove_request("req-nope-000000") is None
    assert not q.holds(es[1].key) and len(q) == 3
    assert q.remove_entries({es[2].key, ("normal", "9999-0")}) == [es[2]]
    assert sorted(q.tenants()) == ["a", "c"]
    assert q.held_by() == Counter({("normal", "a"): 1, ("normal", "c"): 1})
    assert sorted(e.entry_id for e in q.drain()) == sorted([es[0].entry_id, es[3].entry_id])
    assert len(q) == 0 and q.pop(weights()) is None and q.tenants() == []


def test_virtual_times_of_gone_tenants_are_forgotten():
    q = FairQueue(LANES)
    for i in range(PRUNE_EVERY * 2):
        q.push(entry(f"t{i}"))
        q.pop(weights())
        q.push(entry("steady"))
        q.pop(weights())
    assert len(q.vtime) < PRUNE_EVERY + 2


def test_entries_of_two_lanes_with_the_same_id_are_two_entries():
    """Stream ids are per stream: the same id in two lanes names two entries (held, counted and
    removed apart)."""
    q = FairQueue(LANES)
    fields = {ENTRY_TENANT_FIELD.encode(): b"a"}
    high, normal = (Entry(lane, f"stream:{lane}", "7-0", fields) for lane in ("high", "normal"))
    q.push(high)
    q.push(normal)
    assert len(q) == 2 and q.holds(("high", "7-0")) and q.holds(("normal", "7-0"))
    assert q.pop(weights()) is high
    assert len(q) == 1 and q.holds(("normal", "7-0")) and not q.holds(("high", "7-0"))
    q.push(high)
    assert q.remove_entries({("high", "7-0")}) == [high] and q.entries() == [normal]
