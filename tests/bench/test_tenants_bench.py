"""Smoke test of the tenant isolation benchmark (ops/bench/tenants.py) in a tiny configuration: a real
redis-server, a real worker on the tiny model, a noisy client process. Checks the result's structure
and that the quota refused noisy's excess; never the timing goal."""

from __future__ import annotations

import json

from ops.bench import tenants


def test_tenants_bench_tiny_run_rate_limits_noisy(llama_dir, tmp_path, capsys):
    out = tmp_path / "results"
    argv = [
        "--model",
        str(llama_dir),
        "--threads",
        "1",
        "--duration",
        "2",
        "--calm-rate",
        "3",
        "--max-tokens",
        "4",
        "--noisy-max-tokens",
        "16",
        "--noisy-max-queued",
        "2",
        "--burst-interval",
        "0.2",
        "--lead",
        "0.3",
        "--timeout",
        "60",
        "--out",
        str(out),
        "--quiet",
    ]
    assert tenants.main(argv) == 0
    res = json.loads((out / "latest" / "tenants.json").read_text())
    assert list(out.glob("tenants-*.json"))
    assert res["benchmark"] == "tenants"
    assert res["command"] == "python -m ops.bench.tenants " + " ".join(argv)
    assert res["machine"]["threads"] == 1

    assert set(res["phases"]) == set(tenants.PHASES)
    for phase in tenants.PHASES:
        p = res["phases"][phase]
        assert p["requests"] == res["calm"]["requests"] == 6
        assert p["ok"] == p["requests"] and not p["errors"]
        assert p["ttft_s"]["n"] == p["ok"] and 0 < p["ttft_s"]["p50"] <= p["ttft_s"]["p99"]
        assert len(p["ttft_samples_s"]) == p["ok"]
        for part in ("worker_queue_s", "worker_compute_s", "delivery_s"):  # the worker's timings came back
            assert p[part]["n"] == p["ok"]
        assert {"noisy_outstanding", "engine_waiting", "engine_running", "wall_s", "cpu_cores"} <= set(p)
        assert {"worker", "redis", "calm_client"} <= set(p["cpu_cores"])
    assert res["phases"]["solo"]["noisy_outstanding"]["max"] == 0
    assert "noisy_client" in res["phases"]["with_noisy"]["cpu_cores"]

    noisy = res["noisy"]
    assert "error" not in noisy
    assert noisy["sent"] == noisy["bursts"] * res["noisy_setup"]["burst"] == noisy["bursts"] * 20
    assert noisy["rate_limited"] > 0
    assert noisy["rate_limited_by_quota"] == {"max_queued": noisy["rate_limited"]}
    assert noisy["accepted"] >= 2 and noisy["accepted"] + noisy["rate_limited"] == noisy["sent"]
    assert noisy["finished"] == noisy["accepted"] and not noisy["other"].get("unfinished")
    assert res["noisy_outstanding_after"] == 0  # every accepted request gave its slot back

    assert res["ratio_p99"] > 0 and res["goal_ratio"] == 1.2 and isinstance(res["goal_met"], bool)
    printed = capsys.readouterr().out
    assert "RateLimited" in printed and "calm TTFT p99 with noisy / solo" in printed
