"""The serving goal's ratio (ops/bench/serve_ratio.py): each pagedq saturation run paired with an offline
run just before it; without pairs, the offline benchmark's result."""

from __future__ import annotations

import json
import math
import os
from argparse import Namespace

import pytest

from ops.bench import cli
from ops.bench.goals import goals
from ops.bench.serve_ratio import offline_ref, process_cpu_s


@pytest.mark.slow
def test_bench_serve_pairs_each_saturation_run_with_an_offline_run(llama_dir, tmp_path):
    out = tmp_path / "results"
    argv = ["serve", "--quick", "--model", str(llama_dir), "--dtype", "float32", "--threads", "1"]
    argv += ["--systems", "pagedq", "--rates", "", "--long-requests", "0", "--repeats", "2"]
    assert cli.main([*argv, "--out", str(out), "--no-progress"]) == 0
    res = json.loads((out / "latest" / "serve.json").read_text())
    sat = res["systems"]["pagedq"]["saturation"]
    offline, served = sat["offline_pairs"], sat["runs"]
    assert len(offline) == len(served) == 2
    for off in offline:
        assert "error" not in off, off.get("error")
        assert off["output_tokens"] == res["workload"]["output_tokens"]  # the same workload, every token
        assert off["out_tok_s"] > 0 and off["idle_worker_cpu_s"] >= 0
    ref = res["offline_ref"]
    assert ref["method"] == "pairs" and len(ref["pairs"]) == 2
    for pair, off, run in zip(ref["pairs"], offline, served, strict=True):
        assert pair["offline_out_tok_s"] == off["out_tok_s"] and pair["serve_out_tok_s"] == run["out_tok_s"]
        assert pair["ratio"] == pytest.approx(run["out_tok_s"] / off["out_tok_s"])
    assert ref["ratio"] == pytest.approx(sum(p["ratio"] for p in ref["pairs"]) / 2)  # the median of two
    goal = next(g for g in goals({"serve": res}) if g["goal"].startswith("serve: saturation throughput"))
    assert goal["value"] == pytest.approx(ref["ratio"])
    summary = (out / "latest" / "summary.md").read_text()
    assert "median of runs paired with an offline run just before" in summary


def _serve(runs: list[float], pairs: list[dict] | None = None) -> dict:
    sat = {"runs": [{"out_tok_s": r} for r in runs], "out_tok_s": sorted(runs)[len(runs) // 2]}
    if pairs is not None:
        sat["offline_pairs"] = pairs
    return {"workload": {"name": "random"}, "model": {"folder": "m"}, "systems": {"pagedq": {"saturation": sat}}}


def test_offline_ref_without_pairs_uses_the_offline_benchmark(tmp_path):
    args = Namespace(out=str(tmp_path), dtype="float32", threads=1)
    offline = {
        "workload": {"name": "random"},
        "dtype": "float32",
        "threads": 1,
        "model": {"folder": "m"},
        "systems": {"pagedq": {"out_tok_s": 200.0}},
    }
    ref = offline_ref(_serve([150.0, 190.0, 180.0]), args, {"offline": offline})
    assert ref["method"] == "this run's offline benchmark" and ref["ratio"] == pytest.approx(0.9)
    assert offline_ref(_serve([150.0]), args, {"offline": {**offline, "dtype": "bfloat16"}}) == {"available": False}
    assert offline_ref(_serve([150.0]), args, {}) == {"available": False}  # no offline results under --out


def test_offline_ref_skips_failed_offline_runs():
    args = Namespace(out=None, dtype="float32", threads=1)
    pairs = [{"error": "offline: exit code 1"}, {"out_tok_s": 100.0}, {"out_tok_s": 200.0}]
    ref = offline_ref(_serve([50.0, 95.0, 190.0], pairs), args, {})
    assert ref["method"] == "pairs" and [p["ratio"] for p in ref["pairs"]] == [0.95, 0.95]
    assert ref["ratio"] == pytest.approx(0.95)


def test_process_cpu_s_reads_proc():
    assert process_cpu_s(os.getpid()) > 0
    assert math.isnan(process_cpu_s(None))
