"""The uniform-batch benchmark (ops/bench/uniform.py): llama-batched-bench's table parsed, and a tiny
pagedq run whose rows hold every token it claims (the child checks the output count)."""

from __future__ import annotations

import json

from ops.bench import uniform

# Printed by llama-batched-bench (llama.cpp from llama-cpp-python 0.3.36's vendor/llama.cpp) for
# SmolLM2-135M f32, -npp 16 -ntg 8 -npl 4 -t 2.
BATCHED_BENCH_OUTPUT = """
llama_batched_bench: n_kv_max = 1024, n_batch = 2048, n_ubatch = 512, flash_attn = -1, is_pp_shared = 0

|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |
|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|
|    16 |      8 |    4 |     96 |    0.200 |   319.52 |    0.630 |    50.78 |    0.831 |   115.59 |
"""


def test_batched_bench_table_is_parsed():
    (row,) = uniform.parse_batched_bench(BATCHED_BENCH_OUTPUT)
    assert (row["prompt_len"], row["gen_len"], row["batch"]) == (16, 8, 4)
    assert row["s_pp"] == 319.52 and row["s_tg"] == 50.78 and row["s_total"] == 115.59
    assert row["t_pp"] == 0.2 and row["t_tg"] == 0.63


def test_tiny_uniform_run_reports_prefill_and_decode(llama_dir, tmp_path):
    out = tmp_path / "results"
    argv = ["--model", str(llama_dir), "--dtypes", "float32", "--batch", "2,3", "--prompt-len", "8"]
    argv += ["--gen-len", "4", "--threads", "1", "--no-llama-cpp", "--out", str(out), "--timeout", "300"]
    assert uniform.main(argv) == 0
    res = json.loads((out / "latest" / "uniform.json").read_text())
    rows = res["rows"]
    assert [r.get("error") for r in rows] == [None, None]
    assert [r["batch"] for r in rows] == [2, 3]
    for r in rows:
        assert r["system"] == "pagedq" and r["dtype"] == "float32"
        assert r["t_pp"] > 0 and r["t_tg"] > 0
        assert abs(r["s_pp"] - r["batch"] * 8 / r["t_pp"]) < 1e-6 * r["s_pp"]
        assert abs(r["s_tg"] - r["batch"] * 4 / r["t_tg"]) < 1e-6 * r["s_tg"]
