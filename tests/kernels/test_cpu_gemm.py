"""The C++ GEMM (pagedq_kernels/csrc/cpu_gemm.cpp) against a float64 product of the same inputs, in fp32 and
bf16: every output within fp32's summation error bound (plus, in bf16, one bf16 step of the exact
result), tails of rows and columns written and nothing past them, the same bits on one thread and on
two."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pagedq_kernels import cpu
from worker.models.cpu_linear import gemm_bias, gemm_for

SENTINEL = -7.0
DTYPES = [
    pytest.param(
        dt, id=name, marks=pytest.mark.skipif(gemm_for(dt) is None, reason=f"pagedq's GEMM not built for {name}")
    )
    for dt, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16"))
]


def _step(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` values at |x| (zero for fp32, whose rounding is inside the sum's bound)."""
    if dtype == torch.float32:
        return torch.zeros_like(x)
    exponent = torch.floor(torch.log2(x.abs().clamp_min(1e-30)))
    return torch.pow(2.0, exponent - 7)


def _run(x, packed, bias, n, pad=16):
    """The kernel's output written into the first rows and columns of a larger, pre-filled buffer."""
    m = x.shape[0]
    buf = torch.full((m + 1, n + pad), SENTINEL, dtype=x.dtype)
    gemm_for(x.dtype).gemm_linear(x, packed, bias, buf[:m, :n])
    assert torch.all(buf[:m, n:] == SENTINEL), "wrote past the last column"
    assert torch.all(buf[m] == SENTINEL), "wrote past the last row"
    return buf[:m, :n]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [
        (1, 16, 2),
        (2, 17, 34),
        (3, 33, 8),
        (5, 40, 64),
        (6, 64, 576),
        (7, 200, 96),
        (8, 1001, 64),
        (9, 31, 16),
        (13, 960, 576),
        (250, 72, 1538),
        (64, 3072, 576),
        (40, 48, 320),
        (300, 17, 64),
    ],  # every tail of rows (mod 6) and of panels (mod 4), partial panels of 1, 8, 9 and 15 columns; on AMX
    # (K a multiple of 32, 4 rows or more) a tail of 8 rows, an odd panel count, two blocks of rows
)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_matches_the_exact_product(dtype, m, n, k, with_bias):
    torch.manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k + 6, dtype=dtype)[:, 3 : 3 + k]  # rows strided, as a slice of a wider tensor
    w = torch.randn(n, k, dtype=dtype)
    bias = torch.randn(n, dtype=dtype) if with_bias else None
    packed = gemm_for(dtype).pack_gemm_weight(w)
    padded_bias = None if bias is None else gemm_bias(bias, packed)
    exact = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    got = _run(x, packed, padded_bias, n).double()
    # fp32 sums of k terms can be off by k * 2^-24 of the terms' magnitudes (it matters near zero)
    terms = x.double().abs() @ w.double().abs().t() + (0 if bias is None else bias.double().abs())
    bound = _step(exact, dtype) + (k + 1) * 2.0**-24 * terms
    assert torch.all((got - exact).abs() <= bound), "an output outside the error bound"
    if dtype == torch.bfloat16:  # mostly the correctly rounded value
        assert (got == exact.to(torch.bfloat16).double()).float().mean() > 0.9


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_thread_and_two_give_the_same_bits(dtype):
    torch.manual_seed(1)
    x, w = torch.randn(37, 576, dtype=dtype), torch.randn(1000, 576, dtype=dtype)
    packed = gemm_for(dtype).pack_gemm_weight(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(x, packed, None, 1000).clone()
        torch.set_num_threads(2)
        two = _run(x, packed, None, 1000)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_rows_and_bad_arguments(dtype):
    ext = gemm_for(dtype)
    packed = ext.pack_gemm_weight(torch.randn(32, 8, dtype=dtype))
    assert _run(torch.empty(0, 8, dtype=dtype), packed, None, 32).shape == (0, 32)
    out32 = torch.empty(2, 32, dtype=dtype)
    with pytest.raises(RuntimeError, match="of a built dtype"):
        ext.gemm_linear(torch.randn(2, 8, dtype=torch.float16), packed, None, out32)
    with pytest.raises(RuntimeError, match="dtype and K differ"):
        ext.gemm_linear(torch.randn(2, 10, dtype=dtype), packed, None, out32)
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32
    if gemm_for(other) is not None:
        with pytest.raises(RuntimeError, match="dtype and K differ"):
            ext.gemm_linear(torch.randn(2, 8, dtype=other), packed, None, out32.to(other))
    with pytest.raises(RuntimeError, match="not a weight from pack_gemm_weight"):
        ext.gemm_linear(torch.randn(2, 8, dtype=dtype), packed.reshape(4, -1, 8, packed.shape[3]), None, out32)
    with pytest.raises(RuntimeError, match="out \\[M, N\\]"):
        ext.gemm_linear(torch.randn(3, 8, dtype=dtype), packed, None, out32)
    with pytest.raises(RuntimeError, match="overlap"):
        x_in_out = torch.randn(2, 32, dtype=dtype)
        ext.gemm_linear(x_in_out[:, :8], packed, None, x_in_out)
    with pytest.raises(RuntimeError, match="out width"):
        ext.gemm_linear(torch.randn(2, 8, dtype=dtype), packed, None, torch.empty(2, 48, dtype=dtype))
    with pytest.raises(RuntimeError, match="bias fp32, padded"):
        ext.gemm_linear(torch.randn(2, 8, dtype=dtype), packed, torch.zeros(31), out32)


@pytest.mark.skipif(gemm_for(torch.bfloat16) is None, reason="pagedq's GEMM not built for bf16")
def test_bf16_k_must_be_even():
    with pytest.raises(RuntimeError, match="K must be even"):
        gemm_for(torch.bfloat16).pack_gemm_weight(torch.randn(4, 7, dtype=torch.bfloat16))


def test_the_extension_builds_the_gemm_for_what_the_cpu_has():
    ext = cpu.extension()
    assert ext is not None
    flags = cpu._compile_flags()  # AVX-512 where the CPU has it and PAGEDQ_CPU_AVX512 is not 0
    want = (["float32"] if "-mavx512f" in flags else []) + (["bfloat16"] if "-mavx512bf16" in flags else [])
    assert ext.gemm_dtypes() == want


AMX = {"amx_tile", "amx_bf16"} <= cpu.cpu_flags() and "-mavx512bf16" in cpu._compile_flags()


def test_bf16_takes_the_amx_tiles_where_the_cpu_has_them():
    ext = cpu.extension()
    assert ext.gemm_amx_available() == AMX


@pytest.mark.skipif(not AMX, reason="no AMX tiles on this CPU")
def test_the_amx_path_is_the_one_taken_and_agrees_with_the_vector_kernel(tmp_path):
    """The same product with PAGEDQ_CPU_AMX=0 (the vector kernel, in a child process) sums in another order:
    some outputs differ in their last bf16 bit, all within the error bound of the exact product."""
    torch.manual_seed(3)
    x, w = torch.randn(64, 576, dtype=torch.bfloat16), torch.randn(960, 576, dtype=torch.bfloat16)
    torch.save((x, w), tmp_path / "in.pt")
    script = (
        "import sys, torch; from worker.models.cpu_linear import gemm_for; x, w = torch.load(sys.argv[1]); "
        "ext = gemm_for(x.dtype); out = torch.empty(64, 960, dtype=x.dtype); "
        "ext.gemm_linear(x, ext.pack_gemm_weight(w), None, out); torch.save(out, sys.argv[2])"
    )
    env = {**os.environ, "PAGEDQ_CPU_AMX": "0"}
    args = [sys.executable, "-c", script, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")]
    subprocess.run(args, env=env, check=True)
    vector = torch.load(tmp_path / "out.pt")
    tiles = _run(x, gemm_for(torch.bfloat16).pack_gemm_weight(w), None, 960)
    assert not torch.equal(tiles, vector)
    exact = x.double() @ w.double().t()
    bound = _step(exact, torch.bfloat16) + 577 * 2.0**-24 * (x.double().abs() @ w.double().abs().t())
    assert torch.all((tiles.double() - exact).abs() <= bound)
    assert torch.all((vector.double() - exact).abs() <= bound)
