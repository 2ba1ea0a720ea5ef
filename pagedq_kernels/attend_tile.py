"""The inner loop both attention kernels share: one online-softmax step over a tile of paged keys."""

from __future__ import annotations

from pagedq_kernels.triton_compat import jit, tl


@jit
def attend_tile(
    q,
    m_i,
    l_i,
    acc,
    q_pos,
    kv_start,
    seq_lo,
    seq_hi,
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
    kv_head,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    scale_log2,
    window,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step of rows `q` `[M, D_PAD]` over keys `kv_start + [0, BLOCK_N)`.

    Keys outside `[seq_lo, seq_hi)` are neither loaded nor attended; with CAUSAL a row sees keys at
    positions <= its `q_pos`, with USE_WINDOW only keys with `q_pos - k_pos < window`. Each position
    finds its physical block through the block table, so the tile size does not depend on the cache
    block size.
    """
    k_pos = kv_start + tl.arange(0, BLOCK_N)
    k_ok = (k_pos >= seq_lo) & (k_pos < seq_hi)
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    block = tl.load(table_ptr + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
    slot = k_pos % BLOCK_SIZE
    load_mask = k_ok[:, None] & d_ok[None, :]
    k_off = block * stride_kb + slot * stride_ks + kv_head * stride_kh
    k = tl.load(k_cache_ptr + k_off[:, None] + d[None, :], mask=load_mask, other=0.0)

    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [M, BLOCK_N]
    visible = k_ok[None, :]
    if CAUSAL:
        visible = visible & (k_pos[None, :] <= q_pos[:, None])
    if USE_WINDOW:
        visible = visible & (q_pos[:, None] - k_pos[None, :] < window)
    s = tl.where(visible, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v_off = block * stride_vb + slot * stride_vs + kv_head * stride_vh
    v = tl.load(v_cache_ptr + v_off[:, None] + d[None, :], mask=load_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc
