"""Writes into the paged KV cache: new keys/values at their slots, and whole-block copies."""

from __future__ import annotations

import torch

from pagedq_kernels.triton_compat import HAS_TRITON, jit, next_power_of_2, tl

__all__ = ["HAS_TRITON", "copy_blocks", "write_kv_triton"]


@jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_db,
    stride_ds,
    stride_dh,
    NUM_HEADS: tl.constexpr,
    H_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """One program per token: copy its `[Hkv, D]` key and value into slot `slot_mapping[t]`."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    mask = (h < NUM_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    k_dst = k_cache_ptr + block * stride_cb + offset * stride_cs + h[:, None] * stride_ch + d[None, :]
    v_dst = v_cache_ptr + block * stride_db + offset * stride_ds + h[:, None] * stride_dh + d[None, :]
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store key/value `[T, Hkv, D]` (strided views allowed) at their slots; negative slots are skipped."""
    num_tokens, num_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV cache's head dim must be contiguous")
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_heads,
        H_PAD=next_power_of_2(num_heads),
        HEAD_DIM=head_dim,
        D_PAD=next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
    )  # fmt: skip


def copy_blocks(caches: list[torch.Tensor], pairs: torch.Tensor) -> None:
    """Copy whole blocks `pairs[:, 0]` -> `pairs[:, 1]` in every cache tensor (copy-on-write).

    All sources are read before any destination is written, so chains within one call see old data.
    """
    if pairs.numel() == 0:
        return
    for cache in caches:
        idx = pairs.to(device=cache.device, dtype=torch.long)
        cache.index_copy_(0, idx[:, 1], cache.index_select(0, idx[:, 0]))
