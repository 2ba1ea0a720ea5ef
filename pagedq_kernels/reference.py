"""Plain-torch paged attention and cache writes: the engine's CPU path and the oracle of the kernel tests.

Decodes (the first `num_decodes` requests, one query token each) are attended together, in buckets of
requests of similar length so that little is padded. A bucket's visible keys are gathered head-major
(`[n, Hkv, L, D]`, so the matmuls read contiguous rows) with one `index_select` per cache into a reused
buffer; the G query heads sharing a KV head are the G rows of one matmul, so K/V is never repeated.
Padding positions point at a real key of the same request (finite values) and are masked with -inf
before the fp32 softmax.

Each prefill chunk is attended on its own with `scaled_dot_product_attention` (GQA native) and a
causal-with-offset mask; only the keys it can see are gathered.

Everything that follows from the metadata alone (gather indices, masks, buffers) is built once per
step and memoised in `meta.derived`, so a model's layers share it.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedq_kernels.metadata import AttentionMetadata

# Bucketing of decodes: a request joins the current bucket while its key count is at least this
# fraction of the bucket's longest one. Fewer buckets = fewer ops, more padding.
_BUCKET_FILL = 0.8
_MAX_BUCKETS = 8
# Cap on the elements gathered at once per cache (a bucket is split to stay under it): bounds the
# workspace for big batches of long contexts. 8M elements = 32 MB in fp32.
_GATHER_ELEMENTS = 1 << 23


def write_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store key/value `[T, Hkv, D]` at `slot_mapping[t]` of the caches; negative slots are skipped."""
    k_rows = k_cache.view(-1, *k_cache.shape[2:])  # a view: writes land in the cache
    v_rows = v_cache.view(-1, *v_cache.shape[2:])
    slots = slot_mapping.long()
    if slots.numel() and bool((slots < 0).any()):
        keep = slots >= 0
        slots, key, value = slots[keep], key[keep], value[keep]
    k_rows.index_copy_(0, slots, key.to(k_cache.dtype))
    v_rows.index_copy_(0, slots, value.to(v_cache.dtype))


def paged_attention_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of `query` `[T, Hq, D]` over the paged cache; returns `[T, Hq, D]` in query's dtype."""
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    window = sliding_window if sliding_window is not None and sliding_window > 0 else None
    nd = meta.num_decodes
    if nd:
        _decode(query, k_cache, v_cache, meta, scale, window, out)
    if nd < meta.num_seqs:
        _prefill(query, k_cache, v_cache, meta, scale, window, out)
    return out


def prefill_ref(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    out: torch.Tensor,
) -> torch.Tensor:
    """Only the requests after the first `num_decodes` (another kernel handles those decodes)."""
    window = sliding_window if sliding_window is not None and sliding_window > 0 else None
    if meta.num_decodes < meta.num_seqs:
        _prefill(query, k_cache, v_cache, meta, scale, window, out)
    return out


# --- per-step plans -----------------------------------------------------------------------------


def _host_lens(meta: AttentionMetadata) -> tuple[list[int], list[int]]:
    """(query lengths, sequence lengths) as Python ints, without a device sync when the runner gave them."""
    seq = meta.seq_lens_host if meta.seq_lens_host is not None else meta.seq_lens.tolist()
    if meta.query_lens_host is not None:
        ql = meta.query_lens_host
    else:
        loc = meta.query_start_loc.tolist()
        ql = [b - a for a, b in itertools.pairwise(loc)]
    return ql, seq


def _slots(block_table_rows: torch.Tensor, pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of absolute positions `pos` `[n, L]`, `block_table_rows` `[n, max_blocks]` int64."""
    blk = block_table_rows.gather(1, torch.div(pos, block_size, rounding_mode="floor"))
    return blk * block_size + pos % block_size


@dataclass
class _Bucket:
    first: int  # position of its first request in the length-sorted order
    count: int
    length: int  # keys per request, padded
    rows: torch.Tensor  # int64 [count * Hkv * length]: rows of cache.view(-1, D) to gather, head-major
    pad: torch.Tensor | None  # bool [count, 1, 1, length], True = not visible; None when nothing padded


@dataclass
class _DecodePlan:
    order: torch.Tensor  # int64 [nd]: request index of each sorted position
    buckets: list[_Bucket]
    max_rows: int  # of any bucket: the gather buffers' size


def _decode_plan(
    meta: AttentionMetadata,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    window: int | None,
    device: torch.device,
) -> _DecodePlan:
    key = ("ref.decode", block_size, num_kv_heads, head_dim, window, device)
    plan = meta.derived.get(key)
    if plan is not None:
        return plan
    nd = meta.num_decodes
    _, seq = _host_lens(meta)
    lens = seq[:nd]
    starts = [max(0, n - window) if window else 0 for n in lens]
    counts = [n - s for n, s in zip(lens, starts)]
    order = sorted(range(nd), key=counts.__getitem__, reverse=True)

    # Greedy buckets over the sorted key counts, each under the gather cap.
    groups: list[tuple[int, int]] = []  # (first, count)
    i = 0
    while i < nd:
        j = i + 1
        last_bucket = len(groups) >= _MAX_BUCKETS - 1
        per_request = num_kv_heads * counts[order[i]] * head_dim
        while (
            j < nd
            and (last_bucket or counts[order[j]] >= _BUCKET_FILL * counts[order[i]])
            and (j - i + 1) * per_request <= _GATHER_ELEMENTS
        ):
            j += 1
        groups.append((i, j - i))
        i = j

    order_t = torch.tensor(order, dtype=torch.long, device=device)
    tables = meta.block_tables.to(device=device, dtype=torch.long).index_select(0, order_t)
    counts_t = torch.tensor([counts[r] for r in order], dtype=torch.long, device=device)
    starts_t = torch.tensor([starts[r] for r in order], dtype=torch.long, device=device)
    heads = torch.arange(num_kv_heads, device=device).view(1, -1, 1)

    buckets = []
    for first, count in groups:
        sl = slice(first, first + count)
        length = counts[order[first]]
        lpos = torch.arange(length, device=device).view(1, -1)
        n = counts_t[sl].view(-1, 1)
        pos = starts_t[sl].view(-1, 1) + torch.minimum(lpos, n - 1)  # padding repeats a real key
        slot = _slots(tables[sl], pos, block_size)
        rows = (slot.unsqueeze(1) * num_kv_heads + heads).reshape(-1)
        pad = None
        if any(counts[r] != length for r in order[sl]):
            pad = (lpos >= n).view(count, 1, 1, length)
        buckets.append(_Bucket(first, count, length, rows, pad))
    plan = _DecodePlan(order_t, buckets, max(b.rows.numel() for b in buckets))
    meta.derived[key] = plan
    return plan


_workspace = threading.local()


def _gather_buffers(n_rows: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two `[n_rows, D]` buffers for gathered K and V, from a per-thread workspace that only grows.

    Reusing it across layers and steps matters on CPU: a fresh buffer of tens of MB costs page faults
    comparable to the attention itself. Nothing returned to callers aliases it.
    """
    d = like.shape[-1]
    # Tensors made under inference mode cannot be written outside it (and the other way round).
    key = (like.dtype, like.device, torch.is_inference_mode_enabled())
    pool = getattr(_workspace, "pool", None)
    if pool is None:
        pool = _workspace.pool = {}
    buf = pool.get(key)
    need = 2 * n_rows * d
    if buf is None or buf.numel() < need:
        size = need if buf is None else max(need, buf.numel() * 5 // 4)
        buf = pool[key] = torch.empty(size, dtype=like.dtype, device=like.device)
    return buf[: n_rows * d].view(n_rows, d), buf[n_rows * d : need].view(n_rows, d)


@dataclass
class _PrefillPlan:
    request: int
    q_start: int
    q_end: int
    slots: torch.Tensor  # int64 [n]: cache slots of the keys the chunk can see, in position order
    mask: torch.Tensor | None  # bool [q, n], True = visible; None: q == n and plain causal (is_causal)


def _prefill_plans(
    meta: AttentionMetadata, block_size: int, window: int | None, device: torch.device
) -> list[_PrefillPlan]:
    key = ("ref.prefill", block_size, window, device)
    plans = meta.derived.get(key)
    if plans is not None:
        return plans
    qlens, seq = _host_lens(meta)
    tables = meta.block_tables.to(device=device, dtype=torch.long)
    plans, q_start = [], sum(qlens[: meta.num_decodes])
    for i in range(meta.num_decodes, meta.num_seqs):
        q, total = qlens[i], seq[i]
        ctx = total - q  # absolute position of the chunk's first query
        first_key = max(0, ctx - window + 1) if window else 0
        kpos = torch.arange(first_key, total, device=device)
        slots = _slots(tables[i : i + 1], kpos.view(1, -1), block_size).view(-1)
        mask = None
        if ctx > 0 or window:
            qpos = torch.arange(ctx, total, device=device).view(-1, 1)
            mask = kpos.view(1, -1) <= qpos
            if window:
                mask &= qpos - kpos.view(1, -1) < window
        plans.append(_PrefillPlan(i, q_start, q_start + q, slots, mask))
        q_start += q
    meta.derived[key] = plans
    return plans


# --- attention ----------------------------------------------------------------------------------


def _decode(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
    out: torch.Tensor,
) -> None:
    _, block_size, hkv, d = k_cache.shape
    hq = query.shape[1]
    g = hq // hkv
    plan = _decode_plan(meta, block_size, hkv, d, window, k_cache.device)
    kbuf, vbuf = _gather_buffers(plan.max_rows, k_cache)
    k_rows, v_rows = k_cache.view(-1, d), v_cache.view(-1, d)
    # Scaling q first keeps half-precision scores in range; [nd, Hq, D], contiguous.
    q_sorted = query.index_select(0, plan.order).mul_(scale)
    for b in plan.buckets:
        n, length = b.count, b.length
        k = torch.index_select(k_rows, 0, b.rows, out=kbuf[: b.rows.numel()]).view(n, hkv, length, d)
        v = torch.index_select(v_rows, 0, b.rows, out=vbuf[: b.rows.numel()]).view(n, hkv, length, d)
        q = q_sorted[b.first : b.first + n].view(n, hkv, g, d)
        scores = torch.matmul(q, k.transpose(-1, -2)).float()  # [n, Hkv, G, L]
        if b.pad is not None:
            scores.masked_fill_(b.pad, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        res = torch.matmul(probs, v).view(n, hq, d)
        out.index_copy_(0, plan.order[b.first : b.first + n], res.to(out.dtype))


def _prefill(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
    out: torch.Tensor,
) -> None:
    _, block_size, hkv, d = k_cache.shape
    k_rows = k_cache.view(-1, hkv, d)
    v_rows = v_cache.view(-1, hkv, d)
    for p in _prefill_plans(meta, block_size, window, k_cache.device):
        q = query[p.q_start : p.q_end].transpose(0, 1).unsqueeze(0)  # [1, Hq, q, D]
        k = k_rows.index_select(0, p.slots).transpose(0, 1).unsqueeze(0)  # [1, Hkv, n, D]
        v = v_rows.index_select(0, p.slots).transpose(0, 1).unsqueeze(0)
        res = F.scaled_dot_product_attention(
            q, k, v, attn_mask=p.mask, is_causal=p.mask is None, scale=scale, enable_gqa=True
        )
        out[p.q_start : p.q_end] = res[0].transpose(0, 1)
