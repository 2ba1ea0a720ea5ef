"""Smoke test of the hostile-clients benchmark (ops/bench/hostile.py, `pagedq bench hostile`) in a tiny
configuration: a real redis-server, worker and gateway, the attacks in their own process. Checks that it
runs and reports its fields (the waits inside it fail the run when a limit does not act); never a
latency or memory goal."""

from __future__ import annotations

import json

import pytest

from ops.bench import cli, hostile

PHASES = ("baseline", "stall", "slowloris", "disconnect")


def test_pagedq_bench_hostile_is_registered():
    assert cli.DELEGATED["hostile"] == "ops.bench.hostile" and "hostile" in cli.DELEGATED_HELP


@pytest.mark.slow
def test_hostile_bench_tiny_run(llama_dir, tmp_path, capsys):
    out = tmp_path / "results"
    argv = ["--model", str(llama_dir), "--threads", "1", "--phase-s", "1", "--rate", "4"]
    argv += ["--stalled", "10", "--max-streams-per-key", "4", "--slowloris", "4", "--disconnect-loops", "2"]
    argv += ["--disconnect-rate", "10", "--body-read-timeout", "1", "--send-timeout", "3"]
    argv += ["--no-progress", "--out", str(out)]
    assert cli.main(["hostile", *argv]) == 0
    res = json.loads((out / "latest" / "hostile.json").read_text())
    assert list(out.glob("hostile-*.json"))
    assert res["benchmark"] == "hostile" and "error" not in res
    assert res["command"] == "pagedq bench hostile " + " ".join(argv)
    assert res["machine"]["threads"] == 1
    assert "--max-streams-per-key" in res["gateway_limit_flags"]

    for name in PHASES:
        p = res["phases"][name]
        assert p["requests"] == 4 and p["ttft_s"]["n"] == p["ok"]
        assert p["gateway_rss_peak_mib"] > 0 and p["gateway_cpu_s"] >= 0
        if name != "baseline":
            assert p["ttft_p50_ratio"] > 0 and p["ttft_p99_ratio"] > 0
            assert p["rss_before_mib"] > 0 and p["rss_after_mib"] > 0

    stall = res["phases"]["stall"]
    assert stall["stalled"] == 10 and stall["dropped_by_send_timeout"] >= 10
    assert stall["per_key_probe"]["refused_status"] == "429"
    assert stall["per_key_probe"]["code"] == "too_many_streams" and stall["per_key_probe"]["retry_after"]
    assert stall["open_streams_after"] == 0 and stall["kib_per_stalled"] > 0
    assert res["stall_answer"]["tokens"] == 400 and res["stall_answer"]["sse_bytes"] > 0

    slow = res["phases"]["slowloris"]
    assert slow["attack"]["connections"] == 4 and slow["attack"]["opened"] >= 4
    assert {"closed_by_header_timeout", "closed_by_body_timeout"} <= set(slow)

    loop = res["phases"]["disconnect"]
    assert loop["attack"]["cycles"] > 0 and loop["open_streams_after"] == 0
    assert loop["disconnect_cancels"] >= loop["attack"]["cycles"]

    goals = {g["goal"]: g for g in res["goals"]}
    assert len(goals) == 7 and all(isinstance(g["pass"], bool) for g in goals.values())
    assert hostile.GOAL_P99_RATIO == 2.0
    printed = capsys.readouterr().out
    assert "stall: 10 streams" in printed and "disconnect:" in printed
