"""Triton attention over the paged KV cache: the launcher that splits a step between two kernels.

* `pagedq_kernels/decode.py` serves the leading one-token requests with a fixed split-K grid (CUDA-graph safe);
* `pagedq_kernels/prefill.py` serves the prefill / extend chunks after them;
* both share `pagedq_kernels/attend_tile.py`, an online-softmax step over a tile of `BLOCK_N` keys that finds
  each key's block through the block table. Head dims that are not powers of two are padded to the
  next one with masked loads; softmax runs in base 2 on fp32 accumulators.
"""

from __future__ import annotations

import torch

from pagedq_kernels.decode import MIN_PARTITION, decode_num_partitions, launch_decode
from pagedq_kernels.metadata import AttentionMetadata
from pagedq_kernels.prefill import launch_prefill
from pagedq_kernels.triton_compat import HAS_TRITON, next_power_of_2

__all__ = ["HAS_TRITON", "decode_num_partitions", "paged_attention_triton"]

_LOG2E = 1.4426950408889634


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs must not silently drop to tf32: the engine's fp32 path is compared with HF exactly.
    return "ieee" if dtype == torch.float32 else "tf32"


def _tile_config(head_dim_pad: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) for K/V tiles: keep two fp32 stages of K+V in shared memory."""
    block_n = 64 if head_dim_pad <= 128 or dtype != torch.float32 else 32
    return block_n, 4, 2


def paged_attention_triton(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    num_partitions: int | None = None,
    min_partition: int = MIN_PARTITION,
) -> torch.Tensor:
    """Attention of `query` `[T, Hq, D]` over the paged cache (see pagedq_kernels.dispatch.paged_attention).

    `num_partitions` forces the decode grid's split (else `meta.decode_partitions`, else chosen from
    the batch); `min_partition` (a multiple of the key tile) lets tests split short contexts.
    """
    hq, head_dim = query.shape[1:]
    _, block_size, hkv, _ = k_cache.shape
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
    if query.stride(-1) != 1:
        query = query.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("the KV cache's head dim must be contiguous")
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    window = sliding_window if sliding_window is not None and sliding_window > 0 else 0
    d_pad = next_power_of_2(head_dim)
    block_n, num_warps, num_stages = _tile_config(d_pad, query.dtype)
    common = dict(
        scale_log2=scale * _LOG2E,
        window=window,
        stride_qt=query.stride(0),
        stride_qh=query.stride(1),
        stride_kb=k_cache.stride(0),
        stride_ks=k_cache.stride(1),
        stride_kh=k_cache.stride(2),
        stride_vb=v_cache.stride(0),
        stride_vs=v_cache.stride(1),
        stride_vh=v_cache.stride(2),
        stride_ot=out.stride(0),
        stride_oh=out.stride(1),
        stride_bt=meta.block_tables.stride(0),
        GROUP=hq // hkv,
        BLOCK_N=block_n,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        USE_WINDOW=window > 0,
        DOT_PRECISION=_dot_precision(query.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if meta.num_decodes:
        launch_decode(
            query, k_cache, v_cache, out, meta, common, num_partitions=num_partitions, min_partition=min_partition
        )
    if meta.num_seqs > meta.num_decodes:
        launch_prefill(query, k_cache, v_cache, out, meta, common)
    return out
