"""The publisher's hold-back rule for `--stream-interval` (no Redis: only what a flush would write)."""

from __future__ import annotations

import pytest

from producer_sdk.protocol import GenerateRequest
from worker.engine.outputs import CompletionOutput, RequestOutput
from worker.engine.request import RequestMetrics
from worker.service.config import ServiceConfig
from worker.service.inflight import InFlight
from worker.service.metrics import WorkerMetrics
from worker.service.publisher import Publisher, PublisherHooks
from worker.service.retention import Retention


class _FakeRedis:
    def register_script(self, _source):
        return None


def _publisher(interval: int, rids: list[str]) -> Publisher:
    inflight = {
        rid: InFlight(rid, "default", "s", "1-0", GenerateRequest(v=1, request_id=rid, prompt="x"), 100) for rid in rids
    }
    nop = lambda *a: None
    return Publisher(
        _FakeRedis(),
        inflight,
        PublisherHooks(nop, nop, nop, nop),
        model="default",
        group="g",
        consumer="w1",
        live_ttl_ms=1000,
        retention=Retention(default_ms=1000, max_ms=1000),
        metrics=WorkerMetrics("default"),
        stream_interval=interval,
    )


def _out(rid: str, tokens: list[int], finished: bool = False) -> RequestOutput:
    c = CompletionOutput(index=0, text="", token_ids=[], delta_token_ids=tokens)
    return RequestOutput(rid, None, [1], [c], finished, RequestMetrics(arrival=0.0))


def _step(pub: Publisher, *outs: RequestOutput) -> dict[str, list[int]]:
    pub._merge([list(outs)])
    return {p.rec.request_id: p.tokens.get(0, []) for p in pub._due()}


def test_interval_holds_tokens_until_due_and_flushes_first_and_final_at_once():
    pub = _publisher(3, ["a", "b"])
    assert _step(pub, _out("a", [1]), _out("b", [9])) == {"a": [1], "b": [9]}  # first events: at once
    pub.inflight["a"].started = pub.inflight["b"].started = True
    assert _step(pub, _out("a", [2]), _out("b", [10])) == {}
    assert _step(pub, _out("a", [3]), _out("b", [11])) == {}
    assert _step(pub, _out("a", [4]), _out("b", [12], finished=True)) == {"a": [2, 3, 4], "b": [10, 11, 12]}
    assert _step(pub, _out("a", [5])) == {}
    pub._flush_held = True  # what wait_idle asks for before a retry
    assert _step(pub) == {"a": [5]}
    assert pub._held == {}


def test_interval_one_writes_every_step_and_held_tokens_of_a_lost_request_are_dropped():
    pub = _publisher(1, ["a"])
    pub.inflight["a"].started = True
    assert _step(pub, _out("a", [1])) == {"a": [1]}
    pub = _publisher(4, ["a"])
    pub.inflight["a"].started = True
    assert _step(pub, _out("a", [1])) == {}
    pub.inflight["a"].lost = True
    assert _step(pub) == {} and pub._held == {}


def test_stream_interval_must_be_positive():
    with pytest.raises(ValueError, match="stream-interval"):
        ServiceConfig(stream_interval=0)
