"""The fused layer kernels (Triton: interpreter on CPU tensors, real on CUDA) against their torch
references, run on the same device."""

from __future__ import annotations

import pytest
import torch

from pagedq_kernels import use_backend
from pagedq_kernels.fused import add_rms_norm, rms_norm, rms_norm_ref, rotary_embedding, rotary_write_kv, silu_and_mul


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32: a few ulps (fp32 reductions in another order); halves: one unit of the last place."""
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = {torch.float32: (1e-5, 1e-6), torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 8e-3)}[got.dtype]
    torch.testing.assert_close(got, want, rtol=tol[0], atol=tol[1])


@pytest.mark.parametrize("hidden", [128, 200])
def test_rms_norm_and_add_rms_norm(target, hidden):
    device, dtype = target
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(7, hidden + 8, generator=gen) * 3).to(dtype).to(device)[:, 4 : 4 + hidden]  # strided rows
    res = torch.randn(7, hidden, generator=gen).to(dtype).to(device)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(device)
    with use_backend("triton"):
        got = rms_norm(x, w, 1e-6)
        got_norm, got_sum = add_rms_norm(x, res, w, 1e-6)
    want_sum = x + res
    _close(got, rms_norm_ref(x, w, 1e-6))
    assert torch.equal(got_sum, want_sum)  # one rounding of an exact sum: bit-identical
    _close(got_norm, rms_norm_ref(want_sum, w, 1e-6))
    with use_backend("torch"):
        ref_norm, ref_sum = add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(ref_sum, want_sum) and torch.equal(ref_norm, rms_norm_ref(want_sum, w, 1e-6))


@pytest.mark.parametrize("inter", [64, 1500])
def test_silu_and_mul(target, inter):
    device, dtype = target
    gen = torch.Generator().manual_seed(inter)
    x = (torch.randn(5, 2 * inter, generator=gen) * 4).to(dtype).to(device)
    with use_backend("triton"):
        got = silu_and_mul(x)
    with use_backend("torch"):
        want = silu_and_mul(x)
    assert got.shape == (5, inter)
    _close(got, want)
    empty = torch.empty(0, 2 * inter, dtype=dtype, device=device)
    with use_backend("triton"):
        assert silu_and_mul(empty).shape == (0, inter)


def _rope_problem(device, dtype, hq=4, hkv=2, d=64, tokens=9, seed=0):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    positions = torch.randint(0, 40, (tokens,), generator=gen)
    angles = torch.arange(40.0)[:, None] * torch.rand(d // 2, generator=gen)[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    tables = emb.cos() * 1.1, emb.sin() * 1.1  # scaled like yarn's attention factor
    return qkv.to(device), positions.to(device), tables[0].to(device), tables[1].to(device)


def _views(qkv, hq, hkv, d):
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    t = qkv.shape[0]
    return q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)


@pytest.mark.parametrize(("hq", "hkv", "d"), [(4, 2, 64), (3, 1, 80)])
def test_rotary_in_place_on_fused_qkv_views(target, hq, hkv, d):
    device, dtype = target
    base, positions, cos, sin = _rope_problem(device, dtype, hq, hkv, d)
    results = {}
    for backend in ("triton", "torch"):
        qkv = base.clone()
        q, k, _ = _views(qkv, hq, hkv, d)
        with use_backend(backend):
            rotary_embedding(positions, q, k, cos, sin)
        results[backend] = qkv
    _close(results["triton"], results["torch"])
    assert torch.equal(results["triton"][:, (hq + hkv) * d :], base[:, (hq + hkv) * d :]), "v was touched"


def test_rotary_write_kv_skips_padded_slots(target):
    device, dtype = target
    hq, hkv, d, bs = 4, 2, 64, 8
    base, positions, cos, sin = _rope_problem(device, dtype, hq, hkv, d, tokens=9, seed=3)
    slots = torch.tensor([5, -1, 17, 0, 31, -1, 8, 9, 23], device=device)
    caches = {}
    for backend in ("triton", "torch"):
        qkv = base.clone()
        q, k, v = _views(qkv, hq, hkv, d)
        k_cache = torch.full((4, bs, hkv, d), 7.0, dtype=dtype, device=device)
        v_cache = torch.full_like(k_cache, 7.0)
        with use_backend(backend):
            rotary_write_kv(positions, q, k, v, cos, sin, k_cache, v_cache, slots)
        caches[backend] = (qkv, k_cache, v_cache)
    for got, want in zip(caches["triton"], caches["torch"], strict=True):
        _close(got, want)
    k_cache, v_cache = caches["triton"][1:]
    written = set(slots[slots >= 0].tolist())
    for slot in range(4 * bs):
        untouched = bool((k_cache.view(-1, hkv, d)[slot] == 7).all() and (v_cache.view(-1, hkv, d)[slot] == 7).all())
        assert untouched == (slot not in written), f"slot {slot}"
    _, _, v = _views(base, hq, hkv, d)
    assert torch.equal(v_cache.view(-1, hkv, d)[slots[slots >= 0]], v[slots >= 0])  # v copied as is
