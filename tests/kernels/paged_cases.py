"""Random paged-attention problems and a float64 dense oracle, shared by the kernel tests."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from pagedq_kernels.metadata import AttentionMetadata


@dataclass
class Case:
    query: torch.Tensor  # [T, Hq, D], possibly a strided view
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]; slots nobody wrote hold NaN
    v_cache: torch.Tensor
    meta: AttentionMetadata
    scale: float
    window: int | None

    def fresh_meta(self) -> AttentionMetadata:
        """The same batch with an empty `derived` memo."""
        m = self.meta
        return AttentionMetadata(
            query_start_loc=m.query_start_loc,
            seq_lens=m.seq_lens,
            block_tables=m.block_tables,
            slot_mapping=m.slot_mapping,
            max_query_len=m.max_query_len,
            max_seq_len=m.max_seq_len,
            num_decodes=m.num_decodes,
            query_lens_host=m.query_lens_host,
            seq_lens_host=m.seq_lens_host,
        )


def make_case(
    seq_lens: list[int],
    query_lens: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    window: int | None = None,
    seed: int = 0,
    strided_query: bool = False,
    host_lens: bool = True,
    num_decodes: int | None = None,
    device: str = "cpu",
) -> Case:
    """A batch whose first `num_decodes` requests (default: the leading one-token ones) are decodes.
    Built on the CPU from a seeded generator, then moved to `device`."""
    assert len(seq_lens) == len(query_lens)
    assert all(1 <= q <= s for q, s in zip(query_lens, seq_lens))
    gen = torch.Generator().manual_seed(seed)
    if num_decodes is None:
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1
    assert all(q == 1 for q in query_lens[:num_decodes])
    blocks_per_req = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(blocks_per_req) + 2
    # Entries past a request's blocks hold junk ids, often of NaN-filled blocks.
    tables = torch.randint(0, num_blocks, (len(seq_lens), max_blocks), generator=gen, dtype=torch.int32)
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    used = 0
    for i, (s, nb) in enumerate(zip(seq_lens, blocks_per_req)):
        ids = perm[used : used + nb]
        used += nb
        tables[i, :nb] = ids.to(torch.int32)
        pos = torch.arange(s)
        blk, off = ids[pos // block_size], pos % block_size
        k_cache[blk, off] = torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dtype)
        v_cache[blk, off] = torch.randn(s, num_kv_heads, head_dim, generator=gen).to(dtype)
    total = sum(query_lens)
    if strided_query:  # like a slice of a fused QKV projection
        fused = torch.randn(total, num_q_heads + 2 * num_kv_heads, head_dim, generator=gen).to(dtype)
        query = fused.to(device)[:, :num_q_heads]
    else:
        query = torch.randn(total, num_q_heads, head_dim, generator=gen).to(dtype).to(device)
    loc = [0]
    for q in query_lens:
        loc.append(loc[-1] + q)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        slot_mapping=torch.full((total,), -1, dtype=torch.int64, device=device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        num_decodes=num_decodes,
        query_lens_host=list(query_lens) if host_lens else None,
        seq_lens_host=list(seq_lens) if host_lens else None,
    )
    return Case(query, k_cache.to(device), v_cache.to(device), meta, head_dim**-0.5, window)


def dense_attention(case: Case) -> torch.Tensor:
    """float64 attention computed request by request from the gathered cache, on the CPU: the oracle."""
    m = case.meta
    bs = case.k_cache.shape[1]
    hq, hkv = case.query.shape[1], case.k_cache.shape[2]
    query, k_cache, v_cache, tables = case.query.cpu(), case.k_cache.cpu(), case.v_cache.cpu(), m.block_tables.cpu()
    out = torch.zeros(case.query.shape, dtype=torch.float64)
    loc = m.query_start_loc.tolist()
    for i, s in enumerate(m.seq_lens.tolist()):
        q = query[loc[i] : loc[i + 1]].double()  # [q, Hq, D]
        pos = torch.arange(s)
        blk = tables[i].long()[pos // bs]
        k = k_cache[blk, pos % bs].double().repeat_interleave(hq // hkv, dim=1)  # [s, Hq, D]
        v = v_cache[blk, pos % bs].double().repeat_interleave(hq // hkv, dim=1)
        qpos = torch.arange(s - q.shape[0], s).view(-1, 1)
        visible = pos.view(1, -1) <= qpos
        if case.window:
            visible &= qpos - pos.view(1, -1) < case.window
        scores = torch.einsum("qhd,khd->hqk", q, k) * case.scale
        scores = scores.masked_fill(~visible, float("-inf"))
        out[loc[i] : loc[i + 1]] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)
    return out


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """‖got - want‖ / ‖want‖ in float64 (NaN when got has NaN: fails any `<` check)."""
    got, want = got.double().cpu(), want.double().cpu()
    return ((got - want).norm() / want.norm()).item()


@dataclass
class Shape:
    """The randomised knobs of one generated case (kept for test ids and the coverage check)."""

    seq_lens: list[int]
    query_lens: list[int]
    num_decodes: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    window: int | None
    strided_query: bool
    host_lens: bool


def random_shape(seed: int, *, max_context: int = 160) -> Shape:
    """Mixed batch: 0-3 decodes (context 1, block multiples, ragged) then 0-3 chunks of 1..64 tokens."""
    rng = random.Random(seed)
    block_size = rng.choice((16, 32))
    group = rng.choice((1, 2, 4, 8))
    num_kv_heads = rng.choice((1, 2)) if group < 8 else 1
    seq_lens, query_lens = [], []
    num_decodes = rng.randint(0, 3)
    num_prefills = rng.randint(0 if num_decodes else 1, 3)
    for _ in range(num_decodes):
        kind = rng.random()
        if kind < 0.2:
            ctx = 1
        elif kind < 0.45:
            ctx = block_size * rng.randint(1, max_context // block_size)
        else:
            ctx = rng.randint(2, max_context)
        seq_lens.append(ctx)
        query_lens.append(1)
    for _ in range(num_prefills):
        chunk = rng.choice((1, rng.randint(2, 16), rng.randint(17, 64)))
        before = rng.choice((0, block_size, rng.randint(1, max_context - 64)))
        seq_lens.append(before + chunk)
        query_lens.append(chunk)
    return Shape(
        seq_lens=seq_lens,
        query_lens=query_lens,
        num_decodes=num_decodes,
        num_q_heads=group * num_kv_heads,
        num_kv_heads=num_kv_heads,
        head_dim=rng.choice((64, 80, 96, 128)),
        block_size=block_size,
        window=rng.choice((None, None, rng.randint(1, 8), rng.randint(9, 100))),
        strided_query=rng.random() < 0.3,
        host_lens=rng.random() < 0.7,
    )


def case_from_shape(shape: Shape, dtype: torch.dtype, seed: int, device: str = "cpu") -> Case:
    return make_case(
        shape.seq_lens,
        shape.query_lens,
        num_q_heads=shape.num_q_heads,
        num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        block_size=shape.block_size,
        dtype=dtype,
        window=shape.window,
        seed=seed,
        strided_query=shape.strided_query,
        host_lens=shape.host_lens,
        num_decodes=shape.num_decodes,
        device=device,
    )
