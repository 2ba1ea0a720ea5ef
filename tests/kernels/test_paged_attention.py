"""The Triton attention kernels against the reference and a float64 dense attention built from the
gathered cache: on CPU tensors under the interpreter, on CUDA (marked gpu, see conftest.py) for real.

Every call writes into an output poisoned with NaN, and the caches hold NaN wherever nothing was
written (including the blocks that junk block-table entries point at), so any unwritten output or any
read of a slot outside a request's context fails the relative-error check.
"""

from __future__ import annotations

import pytest
import torch
from paged_cases import Case, Shape, case_from_shape, dense_attention, make_case, random_shape, rel_err

from pagedq_kernels import AttentionMetadata, paged_attention, use_backend
from pagedq_kernels.decode import MAX_PARTITIONS, decode_num_partitions
from pagedq_kernels.metadata import DecodeWorkspace
from pagedq_kernels.paged_attention import paged_attention_triton
from pagedq_kernels.reference import paged_attention_ref

# fp32: both sides accumulate in fp32 (tl.dot with ieee precision), 1e-3 leaves a wide margin over
# the ~1e-7 seen. fp16: the kernel rounds the probabilities to fp16 before P @ V and the output at
# the end, each a relative error of at most 2^-11 ~ 4.9e-4; 2e-3 is four units of roundoff. bf16
# (CUDA only): the same roundings at 2^-8, and the reference rounds its scores too.
TOL = {torch.float32: 1e-3, torch.float16: 2e-3, torch.bfloat16: 3e-2}
NUM_RANDOM = 48


def _poisoned(case: Case) -> torch.Tensor:
    return torch.full(case.query.shape, float("nan"), dtype=case.query.dtype, device=case.query.device)


def _check(case: Case, got: torch.Tensor) -> None:
    tol = TOL[case.query.dtype]
    want = dense_attention(case)
    ref = paged_attention_ref(
        case.query, case.k_cache, case.v_cache, case.fresh_meta(), scale=case.scale, sliding_window=case.window
    )
    assert torch.isfinite(got).all(), "unwritten or NaN output"
    assert rel_err(got, want) < tol
    assert rel_err(got, ref) < tol


def _triton(case: Case, num_partitions: int | None = None, min_partition: int = 256) -> torch.Tensor:
    out = _poisoned(case)
    got = paged_attention_triton(
        case.query,
        case.k_cache,
        case.v_cache,
        case.meta,
        scale=case.scale,
        sliding_window=case.window,
        out=out,
        num_partitions=num_partitions,
        min_partition=min_partition,
    )
    assert got is out
    return got


@pytest.mark.parametrize("seed", range(NUM_RANDOM))
def test_random_mixed_batches(seed, target):
    """Odd seeds go through the public dispatch; even ones force up to 8 decode partitions of >= 64 keys."""
    device, dtype = target
    case = case_from_shape(random_shape(seed), dtype, seed, device)
    if seed % 2:
        out = _poisoned(case)
        with use_backend("triton"):
            got = paged_attention(
                case.query, case.k_cache, case.v_cache, case.meta, scale=case.scale,
                sliding_window=case.window, out=out,
            )  # fmt: skip
        assert got is out
    else:
        got = _triton(case, num_partitions=8, min_partition=64)
    _check(case, got)


def test_random_shapes_cover_the_axes():
    shapes: list[Shape] = [random_shape(s) for s in range(NUM_RANDOM)]
    assert {s.head_dim for s in shapes} == {64, 80, 96, 128}
    assert {s.num_q_heads // s.num_kv_heads for s in shapes} == {1, 2, 4, 8}
    assert {s.block_size for s in shapes} == {16, 32}
    assert any(s.window for s in shapes) and any(s.window is None for s in shapes)
    assert any(s.num_decodes and len(s.seq_lens) > s.num_decodes for s in shapes), "no mixed batch"
    assert any(s.strided_query for s in shapes) and not all(s.host_lens for s in shapes)
    decode_lens = {n for s in shapes for n in s.seq_lens[: s.num_decodes]}
    assert 1 in decode_lens and any(n % s.block_size == 0 for s in shapes for n in s.seq_lens)
    chunks = [q for s in shapes for q in s.query_lens[s.num_decodes :]]
    assert 1 in chunks and max(chunks) > 32


@pytest.mark.parametrize(("num_partitions", "min_partition", "window"), [(8, 64, None), (3, 128, None), (8, 64, 150)])
def test_decode_split_into_partitions(num_partitions, min_partition, window, target):
    """Contexts of several partitions, ragged, some empty partitions (short requests, window)."""
    device, dtype = target
    lens = [1, 64, 129, 300, 517]
    case = make_case(
        lens, [1] * len(lens), num_q_heads=4, num_kv_heads=1, head_dim=96, block_size=16,
        dtype=dtype, window=window, seed=7, device=device,
    )  # fmt: skip
    _check(case, _triton(case, num_partitions=num_partitions, min_partition=min_partition))


def test_decode_split_chosen_automatically(target):
    """One long request on a small grid: the launcher itself splits the context."""
    device, dtype = target
    case = make_case([700], [1], num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=32, dtype=dtype, device=device)
    assert decode_num_partitions(1, 1, case.query.device, 700) == 3
    _check(case, _triton(case))


def test_partitions_depend_on_the_batch_not_the_lengths():
    """The grid a CUDA graph captures: fixed by (batch, heads, device, max_model_len) alone."""
    dev = torch.device("cpu")
    assert decode_num_partitions(1, 8, dev, 32768) == 8  # 4 programs x 16 "SMs" / 8 heads
    assert decode_num_partitions(1, 1, dev, 1 << 20) == MAX_PARTITIONS
    assert decode_num_partitions(64, 8, dev, 32768) == 1
    assert decode_num_partitions(1, 8, dev, 300) == 2  # never partitions under 256 keys at max length


def test_fixed_grid_with_padded_requests_and_given_workspace(target):
    """A CUDA-graph-shaped decode batch: 8 partitions for every step, a caller-owned workspace, and
    padded requests of length 0 (slot -1) that attend nothing and must leave the real rows intact."""
    device, dtype = target
    lens = [700, 1, 300, 64]
    case = make_case(
        lens, [1] * 4, num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype, seed=2, device=device
    )
    m = case.meta
    pad = 2
    i32 = dict(dtype=torch.int32, device=device)
    meta = AttentionMetadata(
        query_start_loc=torch.arange(len(lens) + pad + 1, **i32),
        seq_lens=torch.cat([m.seq_lens, torch.zeros(pad, **i32)]),
        block_tables=torch.cat([m.block_tables, torch.zeros(pad, m.block_tables.shape[1], **i32)]),
        slot_mapping=torch.full((len(lens) + pad,), -1, dtype=torch.int64, device=device),
        max_query_len=1,
        max_seq_len=0,  # deliberately wrong: the fixed-grid path must not read host lengths
        num_decodes=len(lens) + pad,
        decode_partitions=8,
        decode_workspace=DecodeWorkspace.allocate(6 * 8, 8, 64, device),
    )
    query = torch.cat([case.query, torch.randn(pad, 8, 64, device=device).to(dtype)])
    out = torch.full(query.shape, float("nan"), dtype=dtype, device=device)
    got = paged_attention_triton(query, case.k_cache, case.v_cache, meta, scale=case.scale, out=out, min_partition=64)
    assert torch.equal(got[len(lens) :], torch.zeros_like(got[len(lens) :]))
    _check(case, got[: len(lens)])


def test_too_small_workspace_is_refused():
    case = make_case([20, 30], [1, 1], num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=16)
    case.meta.decode_workspace = DecodeWorkspace.allocate(3, 2, 64, "cpu")
    with pytest.raises(ValueError, match="workspace"):
        _triton(case, num_partitions=2)


def test_long_chunk_with_window_and_context(target):
    """A 64-token chunk after 100 cached tokens, window shorter than the chunk, next to decodes."""
    device, dtype = target
    case = make_case(
        [37, 200, 164], [1, 1, 64], num_q_heads=8, num_kv_heads=2, head_dim=128, block_size=32,
        dtype=dtype, window=24, seed=3, strided_query=True, device=device,
    )  # fmt: skip
    _check(case, _triton(case))


def test_block_size_8_and_one_token_prefill_chunks():
    case = make_case(
        [9, 17, 1, 24], [1, 1, 1, 1], num_q_heads=3, num_kv_heads=1, head_dim=64, block_size=8,
        num_decodes=1, seed=5,
    )  # fmt: skip
    _check(case, _triton(case))


def test_out_none_returns_query_dtype():
    case = make_case([20, 50], [1, 10], num_q_heads=2, num_kv_heads=2, head_dim=64, block_size=16)
    got = paged_attention_triton(case.query, case.k_cache, case.v_cache, case.meta, scale=case.scale)
    assert got.shape == case.query.shape and got.dtype == case.query.dtype
    _check(case, got)


def test_rejects_bad_partition_settings():
    case = make_case([20], [1], num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=16)
    with pytest.raises(ValueError, match="min_partition"):
        _triton(case, min_partition=48)
    with pytest.raises(ValueError, match="num_partitions"):
        _triton(case, num_partitions=MAX_PARTITIONS + 1)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_strided_out(backend):
    """`out` may be a view (say, part of a bigger buffer): rows and heads are written through strides."""
    case = make_case([30, 70], [1, 25], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, seed=11)
    big = torch.full((case.query.shape[0], 6, 64), float("nan"))
    out = big[:, 1:5]
    with use_backend(backend):
        got = paged_attention(case.query, case.k_cache, case.v_cache, case.meta, scale=case.scale, out=out)
    assert got is out
    _check(case, got)
    assert big[:, 0].isnan().all() and big[:, 5].isnan().all()


def test_cached_workspace_only_grows_and_keeps_outgrown_buffers():
    """A CUDA graph captured on a workspace keeps writing into it: growing must not free it."""
    from pagedq_kernels import decode

    small = decode.cached_workspace(4, 3, 40, torch.device("cpu"))
    assert decode.cached_workspace(2, 3, 40, torch.device("cpu")) is small  # big enough: reused
    grown = decode.cached_workspace(small.rows + 1, 3, 40, torch.device("cpu"))
    assert grown is not small and grown.rows >= 2 * small.rows and grown.fits(small.rows + 1, 3, 40)
    assert any(ws is small for ws in decode._retired)
    assert decode.reserve_decode_workspace(grown.rows, 3, 40, "cpu") is grown
