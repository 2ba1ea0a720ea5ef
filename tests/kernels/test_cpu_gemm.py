"""The C++ bf16 GEMM (kernels/csrc/cpu_gemm.cpp) against a float64 product of the same bf16 inputs:
every output within one bf16 step of the exact result (plus fp32's summation error bound), tails of
rows and columns written and nothing past them, the same bits on one thread and on two."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu
from worker.models.cpu_linear import bf16_gemm

ext = bf16_gemm()
pytestmark = pytest.mark.skipif(ext is None, reason="the bf16 GEMM is built only where the CPU has avx512_bf16")
SENTINEL = -7.0


def _bf16_step(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values at |x| (8 significand bits)."""
    exponent = torch.floor(torch.log2(x.abs().clamp_min(1e-30)))
    return torch.pow(2.0, exponent - 7)


def _run(x, packed, bias, n, pad=16):
    """The kernel's output written into the first n columns of a wider, pre-filled buffer."""
    buf = torch.full((x.shape[0], n + pad), SENTINEL, dtype=torch.bfloat16)
    ext.bf16_linear(x, packed, bias, buf[:, :n])
    assert torch.all(buf[:, n:] == SENTINEL), "wrote past the last column"
    return buf[:, :n]


@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(1, 16, 2), (5, 40, 64), (6, 64, 576), (7, 200, 96), (13, 960, 576), (250, 72, 1538), (64, 3072, 576)],
)
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_matches_the_exact_product(m, n, k, with_bias):
    torch.manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k + 6, dtype=torch.bfloat16)[:, 3 : 3 + k]  # rows strided, as a slice of a wider tensor
    w = torch.randn(n, k, dtype=torch.bfloat16)
    bias = torch.randn(n, dtype=torch.bfloat16) if with_bias else None
    packed = ext.pack_bf16_weight(w)
    padded_bias = None
    if bias is not None:
        padded_bias = torch.zeros(packed.shape[0] * 16)
        padded_bias[:n] = bias.float()
    exact = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    got = _run(x, packed, padded_bias, n).double()
    # fp32 sums of k terms can be off by k * 2^-24 of the terms' magnitudes (it matters near zero)
    summation = k * 2.0**-24 * (x.double().abs() @ w.double().abs().t() + (0 if bias is None else bias.double().abs()))
    assert torch.all((got - exact).abs() <= _bf16_step(exact) + summation), "an output off by more than one bf16 step"
    assert (got == exact.to(torch.bfloat16).double()).float().mean() > 0.9  # mostly the correctly rounded value


def test_one_thread_and_two_give_the_same_bits():
    torch.manual_seed(1)
    x, w = torch.randn(37, 576, dtype=torch.bfloat16), torch.randn(1000, 576, dtype=torch.bfloat16)
    packed = ext.pack_bf16_weight(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(x, packed, None, 1000).clone()
        torch.set_num_threads(2)
        two = _run(x, packed, None, 1000)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_zero_rows_and_bad_arguments():
    w = torch.randn(32, 8, dtype=torch.bfloat16)
    packed = ext.pack_bf16_weight(w)
    assert _run(torch.empty(0, 8, dtype=torch.bfloat16), packed, None, 32).shape == (0, 32)
    with pytest.raises(RuntimeError, match="K must be even"):
        ext.pack_bf16_weight(torch.randn(4, 7, dtype=torch.bfloat16))
    out32 = torch.empty(2, 32, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="x \\[M, K\\] bf16"):
        ext.bf16_linear(torch.randn(2, 8), packed, None, out32)
    with pytest.raises(RuntimeError, match="packed weight"):
        ext.bf16_linear(torch.randn(2, 10, dtype=torch.bfloat16), packed, None, out32)
    with pytest.raises(RuntimeError, match="out width"):
        ext.bf16_linear(torch.randn(2, 8, dtype=torch.bfloat16), packed, None, torch.empty(2, 48, dtype=torch.bfloat16))


def test_the_extension_reports_the_gemm_where_the_cpu_has_bf16_dot_products():
    assert ext.bf16_gemm_available() == ("avx512_bf16" in cpu.cpu_flags())
