"""Triton attention for prefill / extend chunks of any length (the requests after the decodes).

One program owns `BLOCK_Q` query tokens of one request times the G query heads of one KV head,
stacked as `BLOCK_Q * G_PAD` rows of one matrix, so each K/V tile is loaded once for the whole group
(GQA/MQA). Keys are causal inside the chunk and fully visible before it (minus the sliding window).
The grid depends on the step's longest chunk: mixed steps run eagerly, never inside a CUDA graph.
"""

from __future__ import annotations

import torch

from pagedq_kernels.attend_tile import attend_tile
from pagedq_kernels.metadata import AttentionMetadata
from pagedq_kernels.triton_compat import cdiv, jit, next_power_of_2, tl

# Values that change from step to step are never specialised on: a new value must not compile a new
# kernel in the middle of serving (Triton would otherwise key on "== 1" and "% 16 == 0").
PREFILL_PER_STEP_ARGS = ("first_request", "window", "stride_bt")


@jit(do_not_specialize=PREFILL_PER_STEP_ARGS)
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    first_request,
    scale_log2,
    window,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per KV head
    G_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    req = first_request + tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    if q_tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx = seq_len - q_len  # absolute position of the chunk's first token

    # Rows are (token, head) pairs: row r is token r // G_PAD of the tile, head r % G_PAD of the group.
    rows = tl.arange(0, BLOCK_Q * G_PAD)
    tok = q_tile * BLOCK_Q + rows // G_PAD
    head = kv_head * GROUP + rows % G_PAD
    row_ok = (tok < q_len) & (rows % G_PAD < GROUP)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q_off = (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = ctx + tok

    tile_first = ctx + q_tile * BLOCK_Q
    hi = tl.minimum(seq_len, tile_first + BLOCK_Q)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(tile_first - window + 1, 0)
    table_ptr = block_tables_ptr + req.to(tl.int64) * stride_bt

    # The running max starts finite: a fully masked tile then gives p = 0 and alpha = 1, never NaN.
    m_i = tl.full([BLOCK_Q * G_PAD], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_Q * G_PAD], dtype=tl.float32)
    acc = tl.zeros([BLOCK_Q * G_PAD, D_PAD], dtype=tl.float32)
    for kv_start in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, q_pos, kv_start, lo, hi,
            k_cache_ptr, v_cache_ptr, table_ptr, kv_head,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            scale_log2, window,
            BLOCK_N, BLOCK_SIZE, HEAD_DIM, D_PAD, True, USE_WINDOW, DOT_PRECISION,
        )  # fmt: skip

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_off = (q_start + tok).to(tl.int64) * stride_ot + head * stride_oh
    tl.store(
        out_ptr + o_off[:, None] + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )


def launch_prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    meta: AttentionMetadata,
    common: dict,
) -> None:
    """Attend the requests `num_decodes..num_seqs` (`common`: the launch arguments both kernels share)."""
    nd = meta.num_decodes
    g_pad = next_power_of_2(common["GROUP"])
    block_q = max(1, 64 // g_pad)
    if block_q * g_pad < 16:  # tl.dot needs 16 rows
        block_q = 16 // g_pad
    grid = (meta.num_seqs - nd, k_cache.shape[2], cdiv(meta.max_query_len, block_q))
    _prefill_kernel[grid](
        query, k_cache, v_cache, out,
        meta.block_tables, meta.query_start_loc, meta.seq_lens, nd,
        G_PAD=g_pad, BLOCK_Q=block_q, **common,
    )  # fmt: skip
