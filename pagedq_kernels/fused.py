"""Fused layer ops: RMSNorm (+ residual add), SiLU-and-mul, rotary embedding (+ KV-cache write).

Each goes to a Triton kernel for CUDA tensors (pagedq_kernels/fused_triton.py), to the C++ CPU extension
for CPU tensors (pagedq_kernels/csrc/cpu_fused.cpp, when it is built), and to plain torch otherwise,
following the same backend choice as attention (pagedq_kernels/dispatch.py). The torch versions compute
exactly what the unfused model code computes; they are the fallback and the tests' reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedq_kernels.cpu import DTYPES, extension
from pagedq_kernels.dispatch import backend_for, need_triton


def cpu_extension_for(*tensors: torch.Tensor):
    """The C++ extension when these CPU tensors go to it (the "cpu" backend, a dtype it takes, unit
    stride on the last dim), else None."""
    t = tensors[0]
    if t.is_cuda or t.dtype not in DTYPES or backend_for(t) != "cpu":
        return None
    if any(x.stride(-1) != 1 or x.dtype != t.dtype for x in tensors):
        return None
    return extension()


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same operation order as transformers: normalise in fp32, cast back, then scale.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' `x * cos + rotate_half(x) * sin` (cos/sin already in x's dtype, broadcastable)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim."""
    if backend_for(x) == "triton":
        from pagedq_kernels.fused_triton import rms_norm_triton

        need_triton()
        return rms_norm_triton(x, weight, eps)
    ext = cpu_extension_for(x, weight) if x.dim() == 2 else None
    if ext is not None:
        return ext.rms_norm(x, weight, float(eps))
    return rms_norm_ref(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual), x + residual): the residual add and the next norm in one pass."""
    if backend_for(x) == "triton":
        from pagedq_kernels.fused_triton import rms_norm_triton

        need_triton()
        return rms_norm_triton(x, weight, eps, residual=residual)
    ext = cpu_extension_for(x, residual, weight) if x.dim() == 2 and x.shape == residual.shape else None
    if ext is not None:
        out, summed = ext.add_rms_norm(x, residual, weight, float(eps))
        return out, summed
    summed = x + residual
    return rms_norm_ref(summed, weight, eps), summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up` for x = [gate | up] along the last dim."""
    if backend_for(x) == "triton":
        from pagedq_kernels.fused_triton import silu_and_mul_triton

        need_triton()
        return silu_and_mul_triton(x)
    ext = cpu_extension_for(x) if x.dim() == 2 else None
    if ext is not None:
        return ext.silu_and_mul(x)
    gate, up = x.split(x.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> None:
    """Rotate query `[T, Hq, D]` and key `[T, Hkv, D]` in place by the fp32 tables `cos`/`sin`
    `[max_positions, D]` (halves repeated, transformers' layout) at `positions` `[T]`."""
    rotary_write_kv(positions, query, key, None, cos, sin, None, None, None)


def rotary_write_kv(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor | None,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor | None,
    v_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor | None,
) -> None:
    """`rotary_embedding`, then store the rotated keys and `value` at `slot_mapping` of the caches
    (negative slots are skipped), in one kernel on CUDA. Without caches only the rotation happens."""
    if backend_for(query) == "triton":
        from pagedq_kernels.fused_triton import rotary_triton

        need_triton()
        rotary_triton(positions, query, key, cos, sin, value, k_cache, v_cache, slot_mapping)
        return
    caches = () if k_cache is None else (value, k_cache, v_cache)
    ext = cpu_extension_for(query, key, *caches) if cos.dtype == torch.float32 else None
    if ext is not None and cos.stride() == sin.stride():
        slots = None if slot_mapping is None else slot_mapping.to(torch.int64)
        ext.rotary_write_kv(positions.to(torch.int64), query, key, value, cos, sin, k_cache, v_cache, slots)
        return
    c = cos[positions].to(query.dtype).unsqueeze(1)
    s = sin[positions].to(query.dtype).unsqueeze(1)
    query.copy_(rotate_ref(query, c, s))
    key.copy_(rotate_ref(key, c, s))
    if k_cache is not None:
        from pagedq_kernels.reference import write_kv_ref

        write_kv_ref(key, value, k_cache, v_cache, slot_mapping)
