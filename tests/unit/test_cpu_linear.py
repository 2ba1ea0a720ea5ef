"""CPU linears through oneDNN packed weights (worker/models/cpu_linear.py): the same products as
F.linear up to summation order, the plain weight freed, the switch respected."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ops.bench import gemm_paths
from worker.models import cpu_linear

pytestmark = pytest.mark.skipif(not cpu_linear.onednn_available(), reason="torch built without oneDNN")


def _packed(module: nn.Module) -> bool:
    """Packed for pagedq's GEMM or for oneDNN's."""
    return getattr(module, "gemm_weight", None) is not None or getattr(module, "packed_weight", None) is not None


def _holder(n: int, k: int, bias: bool) -> nn.Module:
    m = nn.Module()
    m.weight = nn.Parameter(torch.randn(n, k), requires_grad=False)
    m.bias = nn.Parameter(torch.randn(n), requires_grad=False) if bias else None
    return m


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_packed_linear_matches_f_linear(bias, rows):
    torch.manual_seed(rows)
    mod = _holder(48, 40, bias)
    w, b = mod.weight.clone(), None if mod.bias is None else mod.bias.clone()
    x = torch.randn(rows, 40)
    cpu_linear.pack(mod)
    assert mod.weight.numel() == 0  # the packed copy is the only one left
    torch.testing.assert_close(cpu_linear.linear(x, mod), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, rows, 40)  # leading dims are flattened and restored
    torch.testing.assert_close(cpu_linear.linear(x3, mod), F.linear(x3, w, b), rtol=1e-5, atol=1e-5)


def test_keep_weight_leaves_the_plain_weight():
    mod = _holder(16, 8, False)
    before = mod.weight.clone()
    cpu_linear.pack(mod, keep_weight=True)
    assert torch.equal(mod.weight, before)


def test_switch_and_devices(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv(cpu_linear.ENV, "1")
    assert cpu_linear.packing_enabled(cpu, torch.float32)
    assert not cpu_linear.packing_enabled(cpu, torch.float16)
    assert not cpu_linear.packing_enabled(torch.device("cuda"), torch.float32)
    monkeypatch.setenv(cpu_linear.ENV, "0")
    assert not cpu_linear.packing_enabled(cpu, torch.float32)


def test_loaded_model_packs_and_matches_unpacked(llama_dir, monkeypatch):
    from worker.models.loader import load_model

    monkeypatch.setenv(cpu_linear.ENV, "0")
    plain = load_model(llama_dir, dtype="float32", device="cpu").model
    monkeypatch.setenv(cpu_linear.ENV, "1")
    packed = load_model(llama_dir, dtype="float32", device="cpu").model
    assert _packed(packed.layers[0].self_attn.qkv_proj)
    assert not _packed(plain.layers[0].self_attn.qkv_proj)
    hidden = torch.randn(7, plain.config.hidden_size)
    torch.testing.assert_close(packed.compute_logits(hidden), plain.compute_logits(hidden), rtol=1e-5, atol=1e-5)


def test_gemm_paths_bench_measures_both():
    r = gemm_paths.measure(torch.float32, 3, 16, 8, reps=2)
    ours = {"pagedq"} if cpu_linear.gemm_for(torch.float32) is not None else set()
    assert set(r) == {"F.linear", "onednn"} | ours
    assert all(v["us"] > 0 and v["rel_err"] < 1e-5 for v in r.values())


def test_gemm_caches_are_bounded_for_the_process():
    """Each new step row count compiles new GEMMs; the caches holding them must stay small (a soak
    grew by 220 MiB with the defaults)."""
    import os

    assert int(os.environ["LRU_CACHE_CAPACITY"]) <= 64
    assert int(os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"]) <= 64


bf16_gemm_here = pytest.mark.skipif(
    cpu_linear.gemm_for(torch.bfloat16) is None, reason="pagedq's bf16 GEMM needs avx512_bf16"
)


@bf16_gemm_here
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_projections_take_pagedqs_gemm(bias):
    torch.manual_seed(3)
    mod = _holder(40, 24, bias).to(torch.bfloat16)
    w, b = mod.weight.clone(), None if mod.bias is None else mod.bias.clone()
    cpu_linear.pack(mod)
    assert mod.gemm_weight is not None and getattr(mod, "packed_weight", None) is None
    assert mod.weight.numel() == 0
    x3 = torch.randn(2, 5, 24, dtype=torch.bfloat16)
    want = F.linear(x3.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(cpu_linear.linear(x3, mod).double(), want, rtol=1e-2, atol=2e-2)
    cols = torch.randn(5, 48, dtype=torch.bfloat16)[:, ::2]  # a non-contiguous input is copied first
    torch.testing.assert_close(cpu_linear.linear(cols, mod), cpu_linear.linear(cols.contiguous(), mod), rtol=0, atol=0)


@bf16_gemm_here
def test_bf16_falls_back_to_onednn_when_switched_off_or_k_is_odd(monkeypatch):
    odd = _holder(16, 7, False).to(torch.bfloat16)
    cpu_linear.pack(odd)
    assert getattr(odd, "packed_weight", None) is not None and getattr(odd, "gemm_weight", None) is None
    monkeypatch.setenv(cpu_linear.GEMM_ENV, "0")
    off = _holder(16, 8, False).to(torch.bfloat16)
    cpu_linear.pack(off)
    assert getattr(off, "packed_weight", None) is not None and getattr(off, "gemm_weight", None) is None


@bf16_gemm_here
def test_bf16_model_logits_through_the_gemm_match_f_linear(llama_dir, monkeypatch):
    from worker.models.loader import load_model

    monkeypatch.setenv(cpu_linear.ENV, "0")
    plain = load_model(llama_dir, dtype="bfloat16", device="cpu").model
    monkeypatch.setenv(cpu_linear.ENV, "1")
    packed = load_model(llama_dir, dtype="bfloat16", device="cpu").model
    assert getattr(packed.layers[0].mlp.down_proj, "gemm_weight", None) is not None
    hidden = torch.randn(7, plain.config.hidden_size, dtype=torch.bfloat16)
    torch.testing.assert_close(packed.compute_logits(hidden), plain.compute_logits(hidden), rtol=2e-2, atol=2e-2)


@bf16_gemm_here
def test_gemm_paths_bench_times_pagedqs_gemm_cold():
    r = gemm_paths.measure(torch.bfloat16, 3, 32, 16, reps=2, layers=3)
    assert set(r) == {"F.linear", "onednn", "pagedq"}
    assert all(v["us"] > 0 and v["rel_err"] < 1e-2 for v in r.values())


@pytest.mark.skipif(cpu_linear.gemm_for(torch.float32) is None, reason="pagedq's fp32 GEMM needs AVX-512")
def test_fp32_projections_take_pagedqs_gemm_unless_switched_off(monkeypatch):
    mod, off = _holder(24, 40, True), nn.Module()
    off.weight, off.bias = (nn.Parameter(p.clone(), requires_grad=False) for p in (mod.weight, mod.bias))
    cpu_linear.pack(mod)
    assert mod.gemm_weight is not None and getattr(mod, "packed_weight", None) is None
    monkeypatch.setenv(cpu_linear.GEMM_ENV, "0")
    cpu_linear.pack(off)
    assert off.packed_weight is not None and getattr(off, "gemm_weight", None) is None
    x = torch.randn(9, 40)
    torch.testing.assert_close(cpu_linear.linear(x, mod), cpu_linear.linear(x, off), rtol=1e-5, atol=1e-5)
