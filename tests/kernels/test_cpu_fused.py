"""The C++ CPU fused layer ops (pagedq_kernels/csrc/cpu_fused.cpp, the "cpu" backend) against their torch
references: the residual sum, the rotary embedding and the KV write bit for bit, the norms and
SiLU-mul within a unit of the last place (a mean summed in another order, another exp)."""

from __future__ import annotations

import pytest
import torch

from pagedq_kernels import cpu, use_backend
from pagedq_kernels.fused import add_rms_norm, cpu_extension_for, rms_norm, rms_norm_ref, rotary_write_kv, silu_and_mul

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    tol = {torch.float32: (1e-5, 1e-6), torch.float16: (1e-3, 1e-3), torch.bfloat16: (8e-3, 8e-3)}[got.dtype]
    torch.testing.assert_close(got, want, rtol=tol[0], atol=tol[1])


def _both(fn, *args):
    """fn(*args) on the C++ extension, then on the torch reference, each on its own copies."""
    out = {}
    for backend in ("cpu", "torch"):
        copies = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        with use_backend(backend):
            out[backend] = (fn(*copies), copies)
    return out["cpu"], out["torch"]


def test_the_extension_serves_cpu_tensors():
    assert cpu.extension() is not None
    x = torch.empty(3, 8)
    assert cpu_extension_for(x) is not None
    assert cpu_extension_for(x.t()) is None  # not unit stride on the last dim: the reference
    with use_backend("torch"):
        assert cpu_extension_for(x) is None


@DTYPES
@pytest.mark.parametrize(("rows", "hidden"), [(1, 576), (7, 200), (65, 64), (0, 128)])
def test_rms_norm_and_add_rms_norm(dtype, rows, hidden):
    gen = torch.Generator().manual_seed(rows * 1000 + hidden)
    x = (torch.randn(rows, hidden + 8, generator=gen) * 3).to(dtype)[:, 4 : 4 + hidden]  # strided rows
    res = torch.randn(rows, hidden, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    (got, _), (want, _) = _both(rms_norm, x, w, 1e-6)
    _close(got, want)
    ((got_norm, got_sum), _), ((want_norm, want_sum), _) = _both(add_rms_norm, x, res, w, 1e-6)
    assert torch.equal(got_sum, want_sum) and torch.equal(want_sum, x + res)
    _close(got_norm, want_norm)
    _close(got_norm, rms_norm_ref(x + res, w, 1e-6))


@DTYPES
@pytest.mark.parametrize(("rows", "inter"), [(1, 1536), (5, 61), (33, 64), (0, 16)])
def test_silu_and_mul(dtype, rows, inter):
    gen = torch.Generator().manual_seed(inter)
    x = (torch.randn(rows, 2 * inter, generator=gen) * 4).to(dtype)
    x[:, 0] = torch.tensor([-100.0, 100.0] * rows).to(dtype)[:rows]  # far out on both sides of exp
    (got, _), (want, _) = _both(silu_and_mul, x)
    assert got.shape == (rows, inter)
    _close(got, want)


def _rope_problem(dtype, hq, hkv, d, tokens, seed):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen).to(dtype)
    positions = torch.randint(0, 40, (tokens,), generator=gen)
    angles = torch.arange(40.0)[:, None] * torch.rand(d // 2, generator=gen)[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    return qkv, positions, emb.cos() * 1.1, emb.sin() * 1.1


def _rotate_and_write(qkv, positions, cos, sin, k_cache, v_cache, slots, hq, hkv, d):
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    t = qkv.shape[0]
    rotary_write_kv(
        positions, q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d), cos, sin, k_cache, v_cache, slots
    )


@DTYPES
@pytest.mark.parametrize(("hq", "hkv", "d"), [(9, 3, 64), (3, 1, 80), (2, 2, 72)])
def test_rotary_write_kv_matches_bit_for_bit_and_skips_padded_slots(dtype, hq, hkv, d):
    bs, tokens = 8, 9
    qkv, positions, cos, sin = _rope_problem(dtype, hq, hkv, d, tokens, seed=d)
    slots = torch.tensor([5, -1, 17, 0, 31, -1, 8, 9, 23])
    k_cache = torch.full((4, bs, hkv, d), 7.0, dtype=dtype)
    args = (qkv, positions, cos, sin, k_cache, torch.full_like(k_cache, 7.0), slots, hq, hkv, d)
    (_, got), (_, want) = _both(_rotate_and_write, *args)
    for g, w in zip(got[:1] + got[4:6], want[:1] + want[4:6], strict=True):  # qkv, k_cache, v_cache
        assert torch.equal(g, w)
    assert torch.equal(got[0][:, (hq + hkv) * d :], qkv[:, (hq + hkv) * d :]), "v was touched"
    untouched = (got[4].view(-1, hkv, d) == 7).flatten(1).all(1)
    assert untouched.tolist() == [s not in set(slots.tolist()) for s in range(4 * bs)]


def test_rotation_alone_without_caches():
    qkv, positions, cos, sin = _rope_problem(torch.bfloat16, 4, 2, 64, 5, seed=1)
    (_, got), (_, want) = _both(_rotate_and_write, qkv, positions, cos, sin, None, None, None, 4, 2, 64)
    assert torch.equal(got[0], want[0])


def test_positions_and_slots_outside_their_tensors_are_refused_before_any_write():
    qkv, positions, cos, sin = _rope_problem(torch.float32, 4, 2, 64, 5, seed=2)
    k_cache = torch.zeros(2, 8, 2, 64)
    for bad_positions, bad_slots, match in (
        (torch.tensor([0, 1, 2, 3, 40]), torch.arange(5), "position 40"),
        (positions, torch.tensor([0, 1, 2, 3, 16]), "slot 16"),
    ):
        before = qkv.clone()
        with use_backend("cpu"), pytest.raises(RuntimeError, match=match):
            _rotate_and_write(before, bad_positions, cos, sin, k_cache, torch.zeros_like(k_cache), bad_slots, 4, 2, 64)
        assert torch.equal(before, qkv) and not k_cache.any()
