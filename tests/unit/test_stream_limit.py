"""`--max-streams-per-key` (gateway/stream_limit.py): a key over its limit is refused until one of its streams
ends; requests without a key (a gateway without --api-keys) are counted but never capped by it."""

from __future__ import annotations

import pytest

from gateway.errors import ApiError
from gateway.metrics import GatewayMetrics
from gateway.stream_limit import StreamLimit


def test_a_key_is_capped_and_a_slot_comes_back_once():
    limit = StreamLimit(2, GatewayMetrics(), retry_after_s=1)
    a, b = limit.acquire("k1"), limit.acquire("k1")
    with pytest.raises(ApiError) as refused:
        limit.acquire("k1")
    assert refused.value.status == 429 and refused.value.body.code == "too_many_streams"
    assert limit.acquire("k2").held  # another key has its own count
    a.release()
    a.release()  # a second release gives nothing back
    assert limit.open["k1"] == 1
    limit.acquire("k1")
    with pytest.raises(ApiError):
        limit.acquire("k1")
    b.release()


def test_requests_without_a_key_are_not_capped():
    limit = StreamLimit(2, GatewayMetrics(), retry_after_s=1)
    slots = [limit.acquire(None) for _ in range(10)]
    assert limit.open[""] == 10
    for s in slots:
        s.release()
    assert "" not in limit.open
