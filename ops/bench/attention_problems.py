"""Paged-attention benchmark problems and timers: random paged caches with their metadata, the
same K/V laid out contiguously for SDPA, and a timer per device. Shared by `ops.bench.kernels` and
the GPU device check (`ops.bench.gpu_check*`)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

MODELS = {"smollm2": (9, 3, 64), "llama1b": (32, 8, 64), "llama8b": (32, 8, 128)}  # (Hq, Hkv, D)
# Same group shapes with fewer heads, for runs under the Triton interpreter (it pays per program).
SMALL_HEADS = {"smollm2": (3, 1, 64), "llama1b": (4, 1, 64), "llama8b": (4, 1, 128), "tiny": (4, 2, 32)}
BLOCK_SIZE = 16
# Relative error bounds of Triton vs the reference, both in the input dtype: the reference rounds the
# scores to the input type (HF eager style), the kernel rounds P before P @ V; a few units of roundoff.
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 4e-3}


# --- problems -----------------------------------------------------------------------------------


def build_problem(
    seq_lens: list[int],
    query_lens: list[int],
    heads: tuple[int, int, int],
    dtype: torch.dtype,
    device: str,
    *,
    block_size: int = BLOCK_SIZE,
    seed: int = 0,
):
    """Query, shuffled paged caches and metadata; the leading one-token requests are the decodes."""
    from pagedq_kernels import AttentionMetadata

    hq, hkv, d = heads
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(blocks)
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen, device=device, dtype=dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen, device=device, dtype=dtype)
    perm = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device=device)
    start = 0
    for i, n in enumerate(blocks):
        tables[i, :n] = perm[start : start + n]
        start += n
    num_decodes = 0
    while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
        num_decodes += 1
    loc = [0]
    for q in query_lens:
        loc.append(loc[-1] + q)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables,
        slot_mapping=torch.full((loc[-1],), -1, dtype=torch.int64, device=device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        num_decodes=num_decodes,
        query_lens_host=list(query_lens),
        seq_lens_host=list(seq_lens),
    )
    query = torch.randn(loc[-1], hq, d, generator=gen, device=device, dtype=dtype)
    return query, k_cache, v_cache, meta


def contiguous_kv(cache: torch.Tensor, tables: torch.Tensor, length: int) -> torch.Tensor:
    """`[B, Hkv, L, D]` copy of the first `length` positions of each request (all of equal length)."""
    b = tables.shape[0]
    nblk = math.ceil(length / cache.shape[1])
    flat = cache[tables[:, :nblk].long()].flatten(1, 2)  # [B, nblk * bs, Hkv, D]
    return flat[:, :length].transpose(1, 2).contiguous().view(b, cache.shape[2], length, cache.shape[3])


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm()).item()


# --- timing -------------------------------------------------------------------------------------


def timer(device: str) -> Callable[[Callable[[], object]], float]:
    """Seconds per call: do_bench's median on CUDA; elsewhere the best of five 0.2 s loops (a shared
    CPU's noise only ever adds time)."""
    if device == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=25, rep=100, return_mode="median") / 1e3

    def cpu_time(fn: Callable[[], object]) -> float:
        # Warm up for a second: on a fresh process (and in VMs that reclaim idle memory) the first
        # passes over new buffers run several times slower.
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 1.0:
            fn()
        runs = []
        for _ in range(5):
            n, t0 = 0, time.perf_counter()
            while n < 3 or time.perf_counter() - t0 < 0.2:
                fn()
                n += 1
            runs.append((time.perf_counter() - t0) / n)
        return min(runs)

    return cpu_time


def copy_bandwidth(device: str, nbytes: int, bench: Callable) -> float:
    """Bytes per second moved (read + write) by one large device-to-device `copy_`."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.fill_(1)
    dst = torch.empty_like(src)
    return 2 * nbytes / bench(lambda: dst.copy_(src))


def free_bytes(device: str) -> int:
    if device == "cuda":
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info()[0]
    return 1 << 40  # the dry run only builds tiny problems
