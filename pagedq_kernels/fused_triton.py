"""Triton kernels for the elementwise work around the matmuls of a decoder layer, one launch each:
RMSNorm (optionally after the residual add), SiLU(gate) * up, and rotary embedding of q and k folded
into the KV-cache write.

Each rounds where the unfused torch code (and transformers) rounds: the residual sum and the
normalised activations are cast to the model dtype before use, cos/sin are cast to the activations'
dtype, SiLU's output is rounded before the product; only the arithmetic in between runs in fp32.
"""

from __future__ import annotations

import torch

from pagedq_kernels.triton_compat import cdiv, jit, next_power_of_2, tl


@jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    eps,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """One row: with HAS_RESIDUAL, `res_out = x + res` (rounded) is stored and normalised instead of x."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * stride_ro + cols, s, mask=mask)
        x = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / N + eps)
    y = (x * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


@jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, N: tl.constexpr, BLOCK: tl.constexpr):
    """`out[t] = silu(x[t, :N]) * x[t, N:]`, SiLU rounded to the output dtype first (as F.silu does)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + N + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


@jit
def _rotate_heads(ptr, row_off, heads, cos, sin, HALF: tl.constexpr, H_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    """Rotate heads `[H, 2 * HALF]` at `ptr + row_off[h]` in place (neox layout: halves, not pairs)."""
    h = tl.arange(0, H_PAD)
    j = tl.arange(0, HALF_PAD)
    mask = (h < heads)[:, None] & (j < HALF)[None, :]
    first = ptr + row_off[:, None] + j[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(first, o1.to(ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, o2.to(ptr.dtype.element_ty), mask=mask)
    return o1, o2


@jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cos_ptr,
    sin_ptr,
    pos_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_table,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_db,
    stride_ds,
    stride_dh,
    NUM_Q_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HQ_PAD: tl.constexpr,
    HKV_PAD: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    WRITE_KV: tl.constexpr,
):
    """One token: rotate its q and k heads in place; with WRITE_KV also store rotated k and v at its
    cache slot (a negative slot, a padded token, writes nothing)."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    j = tl.arange(0, HALF_PAD)
    j_ok = j < HALF
    cos = tl.load(cos_ptr + pos * stride_table + j, mask=j_ok, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_table + j, mask=j_ok, other=0.0)
    # Cast to the activations' dtype first, like the tables the unfused model multiplies with.
    cos = cos.to(q_ptr.dtype.element_ty).to(tl.float32)
    sin = sin.to(q_ptr.dtype.element_ty).to(tl.float32)
    hq = tl.arange(0, HQ_PAD)
    _rotate_heads(q_ptr, t * stride_qt + hq * stride_qh, NUM_Q_HEADS, cos, sin, HALF, HQ_PAD, HALF_PAD)
    hk = tl.arange(0, HKV_PAD)
    k1, k2 = _rotate_heads(k_ptr, t * stride_kt + hk * stride_kh, NUM_KV_HEADS, cos, sin, HALF, HKV_PAD, HALF_PAD)
    if WRITE_KV:
        slot = tl.load(slot_ptr + t)
        if slot >= 0:
            block = slot // BLOCK_SIZE
            offset = slot % BLOCK_SIZE
            mask = (hk < NUM_KV_HEADS)[:, None] & j_ok[None, :]
            k_dst = k_cache_ptr + block * stride_cb + offset * stride_cs + hk[:, None] * stride_ch + j[None, :]
            tl.store(k_dst, k1.to(k_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(k_dst + HALF, k2.to(k_cache_ptr.dtype.element_ty), mask=mask)
            v_src = v_ptr + t * stride_vt + hk[:, None] * stride_vh + j[None, :]
            v_dst = v_cache_ptr + block * stride_db + offset * stride_ds + hk[:, None] * stride_dh + j[None, :]
            tl.store(v_dst, tl.load(v_src, mask=mask).to(v_cache_ptr.dtype.element_ty), mask=mask)
            tl.store(v_dst + HALF, tl.load(v_src + HALF, mask=mask).to(v_cache_ptr.dtype.element_ty), mask=mask)


# --- launchers ----------------------------------------------------------------------------------


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as a 2-D `[rows, N]` view with a contiguous last dim."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _norm_warps(n: int) -> int:
    return 4 if n <= 2048 else 8 if n <= 8192 else 16


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of the rows of x; with `residual`, of `x + residual`, returning (normed, sum)."""
    n = x.shape[-1]
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res_out = r2 = out  # unused without a residual: any pointer does
    if residual is not None:
        r2 = _rows(residual)
        res_out = torch.empty(x2.shape, dtype=residual.dtype, device=x.device)
    if x2.shape[0]:
        block = next_power_of_2(n)
        _rms_norm_kernel[(x2.shape[0],)](
            x2, r2, weight, out, res_out,
            x2.stride(0), r2.stride(0), out.stride(0), res_out.stride(0), float(eps),
            N=n, BLOCK=block, HAS_RESIDUAL=residual is not None, num_warps=_norm_warps(block),
        )  # fmt: skip
    if residual is None:
        return out.view(x.shape)
    return out.view(x.shape), res_out.view(x.shape)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """`silu(x[..., :N]) * x[..., N:]` for x `[..., 2N]`."""
    n = x.shape[-1] // 2
    x2 = _rows(x)
    out = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        block = min(1024, next_power_of_2(n))
        _silu_and_mul_kernel[(x2.shape[0], cdiv(n, block))](
            x2, out, x2.stride(0), out.stride(0), N=n, BLOCK=block, num_warps=4
        )
    return out.view(*x.shape[:-1], n)


def rotary_triton(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    value: torch.Tensor | None = None,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
) -> None:
    """Rotate query `[T, Hq, D]` and key `[T, Hkv, D]` in place (cos/sin tables `[P, D]`, halves
    repeated); with the caches given, also store rotated keys and `value` at `slot_mapping`."""
    num_tokens, hq, head_dim = query.shape
    hkv = key.shape[1]
    if query.stride(-1) != 1 or key.stride(-1) != 1:
        raise ValueError("rotary embedding is applied in place: q and k need a contiguous head dim")
    if cos.stride(-1) != 1 or sin.stride() != cos.stride():
        raise ValueError("cos and sin tables must be contiguous rows of the same layout")
    write = k_cache is not None
    if write:
        if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
            raise ValueError("the KV cache's head dim must be contiguous")
        if value.stride(-1) != 1:
            value = value.contiguous()
    else:
        k_cache = v_cache = value = key  # unused
        slot_mapping = positions
    if num_tokens == 0:
        return
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        query, key, value, cos, sin, positions, k_cache, v_cache, slot_mapping,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        cos.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_Q_HEADS=hq, NUM_KV_HEADS=hkv, HQ_PAD=next_power_of_2(hq), HKV_PAD=next_power_of_2(hkv),
        HALF=half, HALF_PAD=next_power_of_2(half), BLOCK_SIZE=k_cache.shape[1] if write else 1,
        WRITE_KV=write, num_warps=4,
    )  # fmt: skip
