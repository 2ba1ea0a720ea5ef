"""The roofline bound of the offline benchmark (ops/bench/roofline.py): its traffic and FLOP counts against
a position-by-position count of the same workload, which side binds, and a measured bandwidth."""

from __future__ import annotations

import pytest

from ops.bench.roofline import kv_bytes_read, measure_bandwidth, model_flops, roofline, weight_bytes
from ops.bench.workloads import BenchRequest, Workload

INFO = {
    "layers": 2,
    "heads": 4,
    "kv_heads": 2,
    "head_dim": 8,
    "matmul_params_layers": 1000,
    "matmul_params_lm_head": 300,
    "kv_bytes_per_token_bf16": 2 * 2 * 2 * 8 * 2,
}


def _workload() -> Workload:
    reqs = [BenchRequest(prompt=list(range(p)), max_tokens=m) for p, m in ((5, 1), (3, 4), (7, 9))]
    return Workload(name="t", seed=0, requests=reqs)


def test_kv_bytes_count_each_prompt_position_once_then_each_decoded_tokens_context():
    positions = 0
    for r in _workload().requests:
        positions += len(r.prompt)  # prefill
        for t in range(1, r.max_tokens):  # the t-th fed-back token reads the prompt and t outputs
            positions += len(r.prompt) + t
    per_position_fp32 = 2 * 2 * 2 * 8 * 4
    assert kv_bytes_read(INFO, _workload(), "float32") == positions * per_position_fp32
    assert kv_bytes_read(INFO, _workload(), "bfloat16") == positions * per_position_fp32 // 2
    assert weight_bytes(INFO, "bfloat16") == 1300 * 2


def test_the_bound_is_the_slower_side():
    wl = _workload()
    flops = model_flops(INFO, wl)
    slow_memory = roofline(
        INFO, wl, "float32", steps=10, useful_flops=flops, matmul_flops=1e12, bandwidth=1e3, elapsed_s=1e3
    )
    assert slow_memory["bound_by"] == "memory" and slow_memory["bound_s"] == slow_memory["memory_s"]
    assert slow_memory["bytes"] == 10 * weight_bytes(INFO, "float32") + kv_bytes_read(INFO, wl, "float32")
    assert slow_memory["share"] == pytest.approx(slow_memory["memory_s"] / 1e3)
    slow_math = roofline(
        INFO, wl, "float32", steps=10, useful_flops=flops, matmul_flops=1.0, bandwidth=1e12, elapsed_s=1.0
    )
    assert slow_math["bound_by"] == "compute" and slow_math["compute_s"] == flops


def test_bandwidth_is_measured_on_this_machine():
    bw = measure_bandwidth("cpu", gib=0.125, reps=2)
    assert bw["bytes"] == 2**27 and 0 < bw["bytes_per_s"] <= bw["bytes_per_s_best"]
