"""The C++ CPU decode kernel (with the reference doing prefills) against float64 dense attention."""

from __future__ import annotations

import pytest
import torch
from paged_cases import case_from_shape, dense_attention, make_case, random_shape, rel_err

from pagedq_kernels import cpu
from pagedq_kernels.reference import paged_attention_ref

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.2e-2}


def test_the_kernel_builds_here():
    assert cpu.extension() is not None, "the C++ kernel did not build (see the warning logged above)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("seed", range(24))
def test_random_mixed_batches(seed, dtype):
    case = case_from_shape(random_shape(seed), dtype, seed)
    out = torch.full(case.query.shape, float("nan"), dtype=dtype)  # poisoned: every row must be written
    got = cpu.paged_attention_cpu(case.query, case.k_cache, case.v_cache, case.fresh_meta(), scale=case.scale,
                                  sliding_window=case.window, out=out)  # fmt: skip
    assert rel_err(got, dense_attention(case)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_long_ragged_decodes_match_the_reference(dtype):
    lens = [1, 7, 16, 17, 300, 513, 1024]
    case = make_case(lens, [1] * len(lens), num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype=dtype)
    got = cpu.paged_attention_cpu(case.query, case.k_cache, case.v_cache, case.fresh_meta(), scale=case.scale)
    want = paged_attention_ref(case.query, case.k_cache, case.v_cache, case.fresh_meta(), scale=case.scale)
    assert rel_err(got, dense_attention(case)) < TOL[dtype]
    assert rel_err(got, want) < TOL[dtype]


def test_falls_back_to_the_reference_when_disabled(monkeypatch):
    monkeypatch.setattr(cpu, "_ext", False)
    case = make_case([5, 40], [1, 9], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16)
    got = cpu.paged_attention_cpu(case.query, case.k_cache, case.v_cache, case.fresh_meta(), scale=case.scale)
    assert rel_err(got, dense_attention(case)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "head_dim"),
    [(16, 1, 64), (12, 2, 80), (6, 2, 72), (4, 4, 40), (8, 2, 256)],
    ids=["group-16", "half-bf16-chunk", "avx2-path-72", "avx2-path-40", "head-256"],
)
@pytest.mark.parametrize("lens", [[3, 64, 65, 200], [200]], ids=["4-requests", "1-request"])
def test_head_shapes_on_every_code_path(dtype, num_q_heads, num_kv_heads, head_dim, lens):
    """Groups wider than one pass of the V sum (8 heads), a head size ending in half a bf16 chunk (80), head
    sizes that are not a multiple of 16 (the AVX2 path even where AVX-512 is), and the widest head; positions
    across several tiles of 64, a partial one, and a request shorter than 16. On two threads, so that one
    request (fewer than the threads) is split by KV head."""
    case = make_case(lens, [1] * len(lens), num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     block_size=16, dtype=dtype)  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = cpu.paged_attention_cpu(case.query, case.k_cache, case.v_cache, case.fresh_meta(), scale=case.scale)
    finally:
        torch.set_num_threads(threads)
    assert rel_err(got, dense_attention(case)) < TOL[dtype]


def test_the_decode_paths_bench_times_a_build_and_agrees_with_itself():
    from ops.bench import cpu_decode_paths

    ext = cpu.extension()
    per_layer, outs = cpu_decode_paths.measure({"a": ext, "b": ext}, torch.float32, 2, 40, (4, 2, 16), layers=2, reps=1)
    assert per_layer["a"] > 0 and per_layer["b"] > 0
    assert torch.equal(outs["a"], outs["b"]) and torch.isfinite(outs["a"]).all()
