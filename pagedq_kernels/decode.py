"""Triton attention for decode requests (one query token each), split-K with a fixed grid.

The grid is `(num_decodes, Hkv, num_partitions)`, where `num_partitions` is chosen on the host from
the batch shape only (never from the step's lengths), so a CUDA graph captured for a batch size stays
valid for every later step. Each program derives its own request's split on the device from
`seq_lens`: a context of n visible keys gets `min(num_partitions, ceil(n / MIN_PART))` partitions; the
programs past that count exit at once. A request with one partition writes its output directly;
otherwise each partition writes a normalised partial output with its log-sum-exp (base 2) to a
workspace and `_combine_kernel` merges them (flash-decoding).

The workspace is never allocated per call: the caller passes one (`AttentionMetadata.decode_workspace`,
what a CUDA-graph runner does) or a grow-only buffer cached per (device, heads, head dim) is used.
"""

from __future__ import annotations

import functools

import torch

from pagedq_kernels.attend_tile import attend_tile
from pagedq_kernels.metadata import AttentionMetadata, DecodeWorkspace
from pagedq_kernels.triton_compat import cdiv, jit, next_power_of_2, tl

# Decode is memory-bound: split contexts until there are about this many programs per SM, never into
# partitions of fewer keys than MIN_PARTITION, never into more than MAX_PARTITIONS.
PROGRAMS_PER_SM = 4
MIN_PARTITION = 256
MAX_PARTITIONS = 64
# Per-step values, never specialised on (see pagedq_kernels/prefill.py).
DECODE_PER_STEP_ARGS = ("window", "num_partitions", "stride_bt")
COMBINE_PER_STEP_ARGS = ("window", "num_partitions")


@jit
def _split(seq_len, window, num_partitions, USE_WINDOW: tl.constexpr, BLOCK_N: tl.constexpr, MIN_PART: tl.constexpr):
    """(lowest visible key, first key of partition 0, keys per partition, partitions) of one request."""
    seq_lo = seq_len * 0
    if USE_WINDOW:
        seq_lo = tl.maximum(seq_len - window, 0)
    first = (seq_lo // BLOCK_N) * BLOCK_N
    span = seq_len - first
    n_parts = tl.maximum(tl.minimum((span + MIN_PART - 1) // MIN_PART, num_partitions), 1)
    per_part = (span + n_parts - 1) // n_parts
    part_size = ((per_part + BLOCK_N - 1) // BLOCK_N) * BLOCK_N
    return seq_lo, first, part_size, n_parts


@jit(do_not_specialize=DECODE_PER_STEP_ARGS)
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,
    part_out_ptr,  # fp32 [rows, NUM_Q_HEADS, HEAD_DIM], row = request * num_partitions + partition
    part_lse_ptr,  # fp32 [rows, NUM_Q_HEADS]
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    scale_log2,
    window,
    num_partitions,
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
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,  # GROUP padded to a power of two >= 16 (the minimum tl.dot height)
    NUM_Q_HEADS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    MIN_PART: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    seq_lo, first, part_size, n_parts = _split(seq_len, window, num_partitions, USE_WINDOW, BLOCK_N, MIN_PART)
    if part >= n_parts:
        return
    lo = tl.maximum(first + part * part_size, seq_lo)
    hi = tl.minimum(first + part * part_size + part_size, seq_len)

    q_row = tl.load(query_start_loc_ptr + req).to(tl.int64)
    g = tl.arange(0, ROWS)
    head = kv_head * GROUP + g
    g_ok = g < GROUP
    d = tl.arange(0, D_PAD)
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + q_row * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    q_pos = tl.zeros([ROWS], dtype=tl.int32) + seq_len - 1
    table_ptr = block_tables_ptr + req.to(tl.int64) * stride_bt
    # A finite running max: an empty partition (or a padded request of length 0) ends with l_i = 0.
    m_i = tl.full([ROWS], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, D_PAD], dtype=tl.float32)
    for kv_start in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, q_pos, kv_start, lo, hi,
            k_cache_ptr, v_cache_ptr, table_ptr, kv_head,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            scale_log2, window,
            BLOCK_N, BLOCK_SIZE, HEAD_DIM, D_PAD, False, False, DOT_PRECISION,
        )  # fmt: skip

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    store_mask = g_ok[:, None] & d_ok[None, :]
    if n_parts == 1:
        o_off = q_row * stride_ot + head * stride_oh
        tl.store(out_ptr + o_off[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        row = (req * num_partitions + part).to(tl.int64) * NUM_Q_HEADS + head  # [ROWS]
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + d[None, :], out, mask=store_mask)
        # An empty partition (l_i = 0) stores -inf and weighs nothing in the combine.
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=g_ok)


@jit(do_not_specialize=COMBINE_PER_STEP_ARGS)
def _combine_kernel(
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    window,
    num_partitions,
    stride_ot,
    stride_oh,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    P_PAD: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_PART: tl.constexpr,
):
    """Merge the partitions of one (request, head): weights 2^(lse_p - max lse), empty ones weigh 0."""
    req = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + req)
    _lo, _first, _size, n_parts = _split(seq_len, window, num_partitions, USE_WINDOW, BLOCK_N, MIN_PART)
    if n_parts == 1:  # the decode kernel wrote this request's output itself
        return
    p = tl.arange(0, P_PAD)
    d = tl.arange(0, D_PAD)
    row = (req * num_partitions + p).to(tl.int64) * NUM_Q_HEADS + head
    lse = tl.load(part_lse_ptr + row, mask=p < n_parts, other=float("-inf"))
    used = lse > float("-inf")
    weight = tl.where(used, tl.exp2(lse - tl.max(lse, 0)), 0.0)
    parts = tl.load(
        part_out_ptr + row[:, None] * HEAD_DIM + d[None, :],
        mask=used[:, None] & (d < HEAD_DIM)[None, :],
        other=0.0,
    )
    out = tl.sum(parts * weight[:, None], 0) / tl.maximum(tl.sum(weight, 0), 1e-30)
    q_row = tl.load(query_start_loc_ptr + req).to(tl.int64)
    tl.store(
        out_ptr + q_row * stride_ot + head * stride_oh + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


# --- host side ----------------------------------------------------------------------------------


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 16  # interpreter: any plausible value


def decode_num_partitions(num_decodes: int, num_kv_heads: int, device: torch.device, max_seq_len: int) -> int:
    """Partitions per request for a decode batch: enough programs to fill the device, none shorter
    than MIN_PARTITION keys at `max_seq_len`. A CUDA-graph runner passes its max_model_len, so the
    answer depends on the batch size alone."""
    wanted = cdiv(PROGRAMS_PER_SM * _num_sms(torch.device(device)), max(1, num_decodes * num_kv_heads))
    return max(1, min(wanted, MAX_PARTITIONS, cdiv(max_seq_len, MIN_PARTITION)))


_cached: dict[tuple, DecodeWorkspace] = {}
# Outgrown buffers stay alive: a CUDA graph captured on one of them keeps writing into it.
_retired: list[DecodeWorkspace] = []


def cached_workspace(rows: int, num_q_heads: int, head_dim: int, device: torch.device) -> DecodeWorkspace:
    """The grow-only workspace of (device, heads, head dim), at least `rows` rows."""
    key = (torch.device(device), num_q_heads, head_dim)
    ws = _cached.get(key)
    if ws is None or ws.rows < rows:
        if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "the decode workspace would grow during CUDA graph capture: pass "
                "AttentionMetadata.decode_workspace, or call pagedq_kernels.reserve_decode_workspace first"
            )
        if ws is not None:
            _retired.append(ws)
        ws = DecodeWorkspace.allocate(max(rows, 2 * ws.rows if ws else rows), num_q_heads, head_dim, device)
        _cached[key] = ws
    return ws


def reserve_decode_workspace(rows: int, num_q_heads: int, head_dim: int, device: torch.device | str) -> DecodeWorkspace:
    """Grow the cached workspace to `rows` now (before a CUDA graph capture, say)."""
    return cached_workspace(rows, num_q_heads, head_dim, torch.device(device))


def launch_decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    meta: AttentionMetadata,
    common: dict,
    *,
    num_partitions: int | None = None,
    min_partition: int = MIN_PARTITION,
) -> None:
    """Attend the first `num_decodes` requests. `num_partitions` (else `meta.decode_partitions`, else a
    choice from the host lengths) fixes the grid; `min_partition` (a multiple of the key tile) is for
    tests that want short contexts split."""
    nd, hq, head_dim = meta.num_decodes, query.shape[1], query.shape[2]
    hkv = k_cache.shape[2]
    block_n = common["BLOCK_N"]
    if min_partition % block_n:
        raise ValueError(f"min_partition {min_partition} is not a multiple of the key tile {block_n}")
    parts = num_partitions or meta.decode_partitions
    if parts is None:
        max_len = max(meta.seq_lens_host[:nd]) if meta.seq_lens_host is not None else meta.max_seq_len
        parts = decode_num_partitions(nd, hkv, query.device, max_len)
    if not 1 <= parts <= MAX_PARTITIONS:
        raise ValueError(f"num_partitions {parts} is not in [1, {MAX_PARTITIONS}]")
    ws = meta.decode_workspace
    if ws is None:
        ws = cached_workspace(nd * parts, hq, head_dim, query.device)
    elif not ws.fits(nd * parts, hq, head_dim):
        raise ValueError(
            f"decode workspace of {ws.rows} rows x {tuple(ws.part_out.shape[1:])} cannot hold "
            f"{nd} requests x {parts} partitions x ({hq}, {head_dim})"
        )
    shared = dict(
        window=common["window"], num_partitions=parts, USE_WINDOW=common["USE_WINDOW"], MIN_PART=min_partition
    )
    _decode_kernel[(nd, hkv, parts)](
        query, k_cache, v_cache, out, ws.part_out, ws.part_lse,
        meta.block_tables, meta.query_start_loc, meta.seq_lens,
        ROWS=max(16, next_power_of_2(common["GROUP"])), NUM_Q_HEADS=hq,
        **shared, **{k: v for k, v in common.items() if k not in shared},
    )  # fmt: skip
    if parts > 1:
        _combine_kernel[(nd, hq)](
            out, ws.part_out, ws.part_lse, meta.query_start_loc, meta.seq_lens,
            stride_ot=out.stride(0), stride_oh=out.stride(1),
            NUM_Q_HEADS=hq, HEAD_DIM=head_dim, D_PAD=common["D_PAD"], P_PAD=MAX_PARTITIONS,
            BLOCK_N=block_n, **shared,
        )  # fmt: skip
