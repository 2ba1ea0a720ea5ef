"""Triton attention over the paged KV cache.

Two kernels share one inner loop (`_attend_tile`, an online-softmax step over a tile of keys):

* `_prefill_kernel` serves prefill / extend chunks of any length. One program owns `BLOCK_Q` query
  tokens of one request times the G query heads of one KV head, stacked as `BLOCK_Q * G_PAD` rows of
  one matrix, so each K/V tile is loaded once for the whole group (GQA/MQA). Keys are causal inside
  the chunk and fully visible before it (minus the sliding window).
* `_decode_kernel` serves the one-token requests. A request's context can be split into partitions,
  each program attends one partition and writes a normalised partial output with its log-sum-exp;
  `_combine_kernel` merges the partitions (flash-decoding). Without a split it writes the output
  directly.

Keys are visited in tiles of `BLOCK_N` positions; each position finds its physical block through the
block table, so the tile size does not depend on the cache block size. Head dims that are not powers
of two are padded to the next one with masked loads. Softmax runs in base 2 on fp32 accumulators.
"""

from __future__ import annotations

import torch

from kernels.metadata import AttentionMetadata

try:
    import triton
    import triton.language as tl

    jit = triton.jit
except ImportError:  # no Triton wheel for this platform: the module still imports, nothing launches
    triton = tl = None

    def jit(fn):
        return fn


HAS_TRITON = triton is not None

_LOG2E = 1.4426950408889634

# Launch shape. Decode is memory-bound: split a context until there are about this many programs
# per SM, but never into partitions of fewer keys than _MIN_PARTITION.
_PROGRAMS_PER_SM = 4
_MIN_PARTITION = 256


@jit
def _attend_tile(
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
    positions <= its `q_pos`, with USE_WINDOW only keys with `q_pos - k_pos < window`.
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


@jit
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
        m_i, l_i, acc = _attend_tile(
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


@jit
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale_log2,
    window,
    partition_size,
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
    stride_pr,  # partial outputs [nd, Hq, P, D] and their lse [nd, Hq, P]
    stride_ph,
    stride_pp,
    stride_lr,
    stride_lh,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,  # GROUP padded to a power of two >= 16 (the minimum tl.dot height)
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    q_row = tl.load(query_start_loc_ptr + req).to(tl.int64)

    g = tl.arange(0, ROWS)
    head = kv_head * GROUP + g
    g_ok = g < GROUP
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM

    seq_lo = 0
    if USE_WINDOW:
        seq_lo = tl.maximum(seq_len - window, 0)
    lo = tl.maximum(part * partition_size, seq_lo)
    hi = tl.minimum(part * partition_size + partition_size, seq_len)
    if SPLIT:  # noqa: SIM102 (a constexpr test, then a runtime one)
        if lo >= hi:  # nothing of this request in this partition
            lse_off = req.to(tl.int64) * stride_lr + head * stride_lh + part
            tl.store(part_lse_ptr + lse_off, tl.full([ROWS], float("-inf"), tl.float32), mask=g_ok)
            return

    q = tl.load(
        q_ptr + q_row * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    q_pos = tl.zeros([ROWS], dtype=tl.int32) + seq_len - 1
    table_ptr = block_tables_ptr + req.to(tl.int64) * stride_bt
    m_i = tl.full([ROWS], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, D_PAD], dtype=tl.float32)
    for kv_start in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, q_pos, kv_start, lo, hi,
            k_cache_ptr, v_cache_ptr, table_ptr, kv_head,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            scale_log2, window,
            BLOCK_N, BLOCK_SIZE, HEAD_DIM, D_PAD, False, False, DOT_PRECISION,
        )  # fmt: skip

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    store_mask = g_ok[:, None] & d_ok[None, :]
    if SPLIT:
        p_off = req.to(tl.int64) * stride_pr + head * stride_ph + part * stride_pp
        tl.store(part_out_ptr + p_off[:, None] + d[None, :], out, mask=store_mask)
        lse_off = req.to(tl.int64) * stride_lr + head * stride_lh + part
        tl.store(part_lse_ptr + lse_off, m_i + tl.log2(l_i), mask=g_ok)
    else:
        o_off = q_row * stride_ot + head * stride_oh
        tl.store(out_ptr + o_off[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=store_mask)


@jit
def _combine_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    query_start_loc_ptr,
    num_partitions,
    stride_ot,
    stride_oh,
    stride_pr,
    stride_ph,
    stride_pp,
    stride_lr,
    stride_lh,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    P_PAD: tl.constexpr,
):
    """Merge the partitions of one (request, head): weights 2^(lse_p - max lse), empty ones weigh 0."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    p = tl.arange(0, P_PAD)
    d = tl.arange(0, D_PAD)
    lse = tl.load(
        part_lse_ptr + req.to(tl.int64) * stride_lr + head * stride_lh + p,
        mask=p < num_partitions,
        other=float("-inf"),
    )
    used = lse > float("-inf")
    weight = tl.where(used, tl.exp2(lse - tl.max(lse, 0)), 0.0)
    part_off = req.to(tl.int64) * stride_pr + head * stride_ph + p * stride_pp
    parts = tl.load(
        part_out_ptr + part_off[:, None] + d[None, :],
        mask=used[:, None] & (d < HEAD_DIM)[None, :],
        other=0.0,
    )
    out = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    q_row = tl.load(query_start_loc_ptr + req).to(tl.int64)
    tl.store(
        out_ptr + q_row * stride_ot + head * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


# --- launchers ----------------------------------------------------------------------------------


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs must not silently drop to tf32: the engine's fp32 path is compared with HF exactly.
    return "ieee" if dtype == torch.float32 else "tf32"


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 16  # interpreter: any plausible value


def decode_partition_size(
    num_decodes: int, num_kv_heads: int, max_seq_len: int, device: torch.device, block_n: int
) -> int:
    """Keys per partition: split long contexts only while the grid is too small to fill the device."""
    programs = num_decodes * num_kv_heads
    wanted = triton.cdiv(_PROGRAMS_PER_SM * _num_sms(device), programs)
    parts = max(1, min(wanted, max_seq_len // _MIN_PARTITION))
    return triton.cdiv(triton.cdiv(max_seq_len, parts), block_n) * block_n


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
    partition_size: int | None = None,
) -> torch.Tensor:
    """Attention of `query` `[T, Hq, D]` over the paged cache (see kernels.paged_attention).

    `partition_size` (a multiple of the kernel's key tile) forces the decode split, for tests.
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
    group = hq // hkv
    d_pad = triton.next_power_of_2(head_dim)
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
        GROUP=group,
        BLOCK_N=block_n,
        BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim,
        D_PAD=d_pad,
        USE_WINDOW=window > 0,
        DOT_PRECISION=_dot_precision(query.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    nd = meta.num_decodes
    if nd:
        _launch_decode(query, k_cache, v_cache, out, meta, common, partition_size)
    if meta.num_seqs > nd:
        g_pad = triton.next_power_of_2(group)
        block_q = max(1, 64 // g_pad)
        if block_q * g_pad < 16:  # tl.dot needs 16 rows
            block_q = 16 // g_pad
        grid = (meta.num_seqs - nd, hkv, triton.cdiv(meta.max_query_len, block_q))
        _prefill_kernel[grid](
            query, k_cache, v_cache, out,
            meta.block_tables, meta.query_start_loc, meta.seq_lens, nd,
            G_PAD=g_pad, BLOCK_Q=block_q, **common,
        )  # fmt: skip
    return out


def _launch_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    meta: AttentionMetadata,
    common: dict,
    partition_size: int | None,
) -> None:
    nd, hq, head_dim = meta.num_decodes, query.shape[1], query.shape[2]
    hkv = k_cache.shape[2]
    block_n = common["BLOCK_N"]
    max_len = meta.max_seq_len
    if meta.seq_lens_host is not None:
        max_len = max(meta.seq_lens_host[:nd])
    if partition_size is None:
        partition_size = decode_partition_size(nd, hkv, max_len, query.device, block_n)
    if partition_size % block_n:
        raise ValueError(f"partition_size {partition_size} is not a multiple of the key tile {block_n}")
    parts = triton.cdiv(max_len, partition_size)
    split = parts > 1
    if split:
        part_out = torch.empty((nd, hq, parts, head_dim), dtype=torch.float32, device=query.device)
        part_lse = torch.empty((nd, hq, parts), dtype=torch.float32, device=query.device)
    else:  # unused, any pointer does
        part_out = part_lse = out
    rows = max(16, triton.next_power_of_2(common["GROUP"]))
    _decode_kernel[(nd, hkv, parts)](
        query, k_cache, v_cache, out, part_out, part_lse,
        meta.block_tables, meta.query_start_loc, meta.seq_lens,
        partition_size=partition_size,
        stride_pr=part_out.stride(0) if split else 0,
        stride_ph=part_out.stride(1) if split else 0,
        stride_pp=part_out.stride(2) if split else 0,
        stride_lr=part_lse.stride(0) if split else 0,
        stride_lh=part_lse.stride(1) if split else 0,
        ROWS=rows, SPLIT=split, **common,
    )  # fmt: skip
    if split:
        _combine_kernel[(nd, hq)](
            out, part_out, part_lse, meta.query_start_loc, parts,
            out.stride(0), out.stride(1),
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1),
            HEAD_DIM=head_dim, D_PAD=common["D_PAD"], P_PAD=max(2, triton.next_power_of_2(parts)),
        )  # fmt: skip
