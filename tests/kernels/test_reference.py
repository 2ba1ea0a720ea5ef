"""The torch reference (the engine's CPU path) against float64 dense attention."""

from __future__ import annotations

import pytest
import torch
from paged_cases import case_from_shape, dense_attention, make_case, random_shape, rel_err

from pagedq_kernels.reference import paged_attention_ref


def _run(case, meta=None, **kw):
    out = torch.full(case.query.shape, float("nan"), dtype=case.query.dtype)
    got = paged_attention_ref(
        case.query,
        case.k_cache,
        case.v_cache,
        meta if meta is not None else case.meta,
        scale=case.scale,
        sliding_window=case.window,
        out=out,
        **kw,
    )
    assert got is out
    return got


@pytest.mark.parametrize("seed", range(40))
def test_reference_fp32_matches_dense(seed):
    case = case_from_shape(random_shape(seed), torch.float32, seed)
    assert rel_err(_run(case), dense_attention(case)) < 1e-5


# Half precision: the reference rounds q*scale, the scores and the probabilities to the input type
# (like HF eager attention), then the output; a few units of roundoff (fp16 2^-11, bf16 2^-8).
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("seed", range(6))
def test_reference_half_matches_dense(seed, dtype, tol):
    case = case_from_shape(random_shape(seed), dtype, seed)
    assert rel_err(_run(case), dense_attention(case)) < tol


def test_long_ragged_decodes_use_several_buckets():
    lens = [1, 7, 16, 31, 32, 100, 150, 233, 300, 301, 480, 512, 700]
    case = make_case(lens, [1] * len(lens), num_q_heads=9, num_kv_heads=3, head_dim=64, block_size=16)
    got = _run(case)
    plan = next(v for k, v in case.meta.derived.items() if k[0] == "ref.decode")
    assert len(plan.buckets) > 1
    assert rel_err(got, dense_attention(case)) < 1e-5


def test_memo_is_shared_by_layers_and_keyed_by_window():
    """One metadata, two layers (same layout, other cache contents), then a sliding-window layer."""
    lens, qlens = [40, 3, 90, 70], [1, 1, 20, 70]
    layer0 = make_case(lens, qlens, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, seed=1)
    layer1 = make_case(lens, qlens, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, seed=1)
    layer1.k_cache.mul_(-0.5).add_(0.25)  # unwritten slots stay NaN
    layer1.v_cache.mul_(2.0)
    meta = layer0.meta
    for case in (layer0, layer1, layer0):
        assert rel_err(_run(case, meta), dense_attention(case)) < 1e-5
    assert meta.derived
    layer0.window = 5
    assert rel_err(_run(layer0, meta), dense_attention(layer0)) < 1e-5


def test_without_host_lengths_and_without_out():
    case = make_case(
        [5, 33, 64], [1, 4, 64], num_q_heads=2, num_kv_heads=1, head_dim=80, block_size=32, host_lens=False
    )
    got = paged_attention_ref(case.query, case.k_cache, case.v_cache, case.meta, scale=case.scale)
    assert got.shape == case.query.shape and got.dtype == case.query.dtype
    assert rel_err(got, dense_attention(case)) < 1e-5


def test_block_size_8_and_single_token_prefill_chunks():
    case = make_case(
        [9, 17, 1, 24],
        [1, 1, 1, 1],
        num_q_heads=8,
        num_kv_heads=2,
        head_dim=64,
        block_size=8,
        num_decodes=1,
        window=4,
    )
    assert rel_err(_run(case), dense_attention(case)) < 1e-5


def test_gather_cap_splits_buckets(monkeypatch):
    import pagedq_kernels.reference as reference

    monkeypatch.setattr(reference, "_GATHER_ELEMENTS", 3 * 64 * 100)  # about one request per bucket
    lens = [90, 95, 99, 50, 3, 100]
    case = make_case(lens, [1] * len(lens), num_q_heads=6, num_kv_heads=3, head_dim=64, block_size=16)
    got = _run(case)
    plan = next(v for k, v in case.meta.derived.items() if k[0] == "ref.decode")
    assert len(plan.buckets) >= 5
    assert rel_err(got, dense_attention(case)) < 1e-5
