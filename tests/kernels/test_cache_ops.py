"""write_kv (Triton: interpreter on CPU tensors, real on CUDA; and the torch path) and copy_blocks."""

from __future__ import annotations

import pytest
import torch

from pagedq_kernels import copy_blocks, use_backend, write_kv
from pagedq_kernels.cache_ops import write_kv_triton
from pagedq_kernels.reference import write_kv_ref


def _expected(key, value, k_cache, v_cache, slots):
    k_want, v_want = k_cache.clone(), v_cache.clone()
    bs = k_cache.shape[1]
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_want[slot // bs, slot % bs] = key[t].to(k_cache.dtype)
            v_want[slot // bs, slot % bs] = value[t].to(v_cache.dtype)
    return k_want, v_want


@pytest.mark.parametrize("impl", [write_kv_triton, write_kv_ref], ids=["triton", "torch"])
@pytest.mark.parametrize(
    ("num_kv_heads", "head_dim", "block_size", "dtype"),
    [(1, 64, 16, torch.float32), (3, 80, 32, torch.float16), (2, 96, 8, torch.float32), (4, 128, 16, torch.float16)],
)
def test_write_kv(impl, num_kv_heads, head_dim, block_size, dtype, device):
    gen = torch.Generator().manual_seed(num_kv_heads * head_dim)
    num_blocks, tokens = 6, 21
    # key/value as strided views of a fused projection output, like the model passes them.
    fused = torch.randn(tokens, 3 * num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    key, value = fused[:, num_kv_heads : 2 * num_kv_heads], fused[:, 2 * num_kv_heads :]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    slots[::4] = -1  # padding tokens: not written
    slots = slots.to(device)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    v_cache = torch.randn_like(k_cache)
    k_want, v_want = _expected(key, value, k_cache, v_cache, slots)
    impl(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_want)
    assert torch.equal(v_cache, v_want)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_write_kv_dispatch_all_skipped_and_empty(backend):
    k_cache = torch.zeros(2, 16, 1, 64)
    v_cache = torch.zeros_like(k_cache)
    key = torch.ones(3, 1, 64)
    with use_backend(backend):
        write_kv(key, key, k_cache, v_cache, torch.full((3,), -1, dtype=torch.int64))
        write_kv(key[:0], key[:0], k_cache, v_cache, torch.empty(0, dtype=torch.int64))
    assert not k_cache.any() and not v_cache.any()
    with use_backend(backend):
        write_kv(key, 2 * key, k_cache, v_cache, torch.tensor([0, 17, 31]))
    assert k_cache.sum() == 3 * 64 and v_cache.sum() == 6 * 64
    assert k_cache[1, 1].sum() == 64 and k_cache[1, 15].sum() == 64


def test_copy_blocks():
    caches = [torch.randn(5, 16, 2, 64) for _ in range(4)]
    before = [c.clone() for c in caches]
    pairs = torch.tensor([[0, 3], [3, 1], [4, 2]])  # 3 is read before it is overwritten
    copy_blocks(caches, pairs)
    for c, old in zip(caches, before):
        assert torch.equal(c[3], old[0]) and torch.equal(c[1], old[3]) and torch.equal(c[2], old[4])
        assert torch.equal(c[0], old[0]) and torch.equal(c[4], old[4])
    copy_blocks(caches, torch.empty(0, 2, dtype=torch.long))
