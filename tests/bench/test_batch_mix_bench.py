"""Smoke test of the Batch API benchmark (ops/bench/batch_mix.py, `pagedq bench batch`) with --quick on
the tiny model: a real redis-server, worker and gateway, a batch through the official `openai` client.
Checks the result's structure and that both batches finished every line once; never a timing goal."""

from __future__ import annotations

import json

import pytest

from ops.bench import batch_mix, cli

PHASES = ("interactive_alone", "interactive_with_batch")


def test_pagedq_bench_batch_is_registered():
    assert cli.DELEGATED["batch"] == "ops.bench.batch_mix" and "batch" in cli.DELEGATED_HELP


@pytest.mark.slow
def test_batch_bench_quick_run(llama_dir, tmp_path, capsys):
    out = tmp_path / "results"
    argv = ["--quick", "--model", str(llama_dir), "--threads", "1", "--batch-lines", "120"]
    argv += ["--duration", "2", "--rate", "4", "--lead", "0.5", "--no-progress", "--out", str(out)]
    argv += ["--cancel-after-window"]  # each batch cancelled after its window (or already completed)
    assert cli.main(["batch", *argv]) == 0
    res = json.loads((out / "latest" / "batch.json").read_text())
    assert list(out.glob("batch-*.json"))
    assert res["benchmark"] == "batch" and res["quick"] is True and "error" not in res
    assert res["command"] == "pagedq bench batch " + " ".join(argv)
    assert res["machine"]["threads"] == 1

    sat = res["saturation"]
    assert sat["ok"] == sat["requests"] == 8 and sat["req_s"] > 0
    assert res["interactive"]["rate_req_s"] == 4 and res["interactive"]["requests"] == 8
    for phase in PHASES:
        p = res["phases"][phase]
        assert p["ok"] == p["requests"] == 8 and not p["errors"]
        assert p["ttft_s"]["n"] == 8 and 0 < p["ttft_s"]["p50"] <= p["ttft_s"]["p99"]
        assert len(p["ttft_samples_s"]) == 8 and p["out_tokens"] == 8 * res["interactive"]["max_tokens"]
        assert p["worker_gen_tokens"] >= p["out_tokens"]
    during = res["phases"]["interactive_with_batch"]["batch_during"]
    assert {"tokens", "tok_s", "lines_done_at_end", "batch_ran_whole_window"} <= set(during)

    for name in ("batch_with_interactive", "batch_alone"):
        b = res[name]
        assert b["status"] in ("completed", "cancelled"), b
        assert b["total"] == 120 and b["completed"] == b["output_lines"] == b["distinct_custom_ids"], b
        assert b["failed"] == 0 and b["no_line_twice"]
        assert b["output_tokens"] == b["completed"] * res["batch"]["max_tokens"]
        if b["status"] == "completed":
            assert b["completed"] == 120 and b["every_line_once"]
    assert {"wall_s", "tokens", "tok_s", "batch_ended_in_window"} <= set(res["batch_alone"]["window"])
    assert res["batch_alone"]["whole_run"]["tokens"] >= res["batch_alone"]["output_tokens"] * 0.5

    assert res["goal_ratio"] == batch_mix.GOAL_RATIO == 1.2
    assert res["ttft_p99_ratio"] > 0 and isinstance(res["goal_met"], bool)
    assert res["batch_tok_s_idle"] > 0 and res["batch_share_of_idle"] >= 0
    printed = capsys.readouterr().out
    assert "interactive TTFT p99 with batch / without" in printed and "batch tokens/s with interactive" in printed
