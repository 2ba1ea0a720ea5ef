"""A shortened soak in CI (`make soak` runs the full 2,000 requests)."""

from __future__ import annotations

import pytest

from tests.chaos.soak import run_soak

pytestmark = [pytest.mark.chaos, pytest.mark.slow]


def test_soak_mixed_traffic_leaks_nothing(llama_dir):
    report = run_soak(str(llama_dir), requests=400, concurrency=48, seed=3)
    assert not report.wrong, report.wrong[:5]
    assert report.good and report.cancelled_prefix and report.deadline_prefix and report.bad_entries
    assert report.completed_exact + report.cancelled_prefix + report.deadline_prefix == report.good
    assert report.bad_answered == report.bad_entries
    assert report.kv_usage_end == 0.0 and report.running_end == 0.0
    assert not report.orphan_keys, report.orphan_keys
    assert report.ok, report
