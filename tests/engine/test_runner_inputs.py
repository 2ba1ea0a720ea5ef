"""The runner's host side, without a device: step batches from the scheduler's output, the padded
layout a decode graph reads, the batch-size buckets, and the staging of uploads (alignment, reuse)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from worker.engine.cuda_graphs import MAX_CAPTURE_SIZE, bucket_for, capture_sizes
from worker.engine.scheduler import ScheduledSeq
from worker.engine.step_inputs import build_step_batch, pad_decode, warm_up_batch
from worker.engine.transfer import Uploader, to_host


def _sched(*specs: tuple[list[int], int, int, list[int]]) -> list[ScheduledSeq]:
    """(token ids, computed, new, block table) per request."""
    return [
        ScheduledSeq(SimpleNamespace(token_ids=ids, num_computed_tokens=done), new, table)
        for ids, done, new, table in specs
    ]


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs():
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(256)
    assert sizes[:7] == [1, 2, 4, 8, 16, 24, 32] and sizes[-1] == 256 and len(sizes) == 35
    assert capture_sizes(4096)[-1] == MAX_CAPTURE_SIZE
    for top in (1, 7, 20, 64, 100):
        sizes = capture_sizes(top)
        assert sizes == sorted(set(sizes))
        for n in range(1, top + 1):
            b = bucket_for(n, sizes)
            assert b >= n and not any(n <= s < b for s in sizes)  # the smallest that fits
        assert bucket_for(top + 1, sizes) is None and bucket_for(0, sizes) is None


def test_step_batch_flattens_decodes_then_chunks():
    bs = 4
    sched = _sched(
        ([5, 6, 7, 8, 9, 10], 5, 1, [3, 8]),  # a decode at position 5: block 8, offset 1
        (list(range(20, 30)), 2, 7, [1, 0, 6]),  # a chunk of 7 tokens from position 2
    )
    batch = build_step_batch(sched, 1, [0, 1], bs)
    assert batch.input_ids.tolist() == [10, 22, 23, 24, 25, 26, 27, 28]
    assert batch.positions.tolist() == [5, 2, 3, 4, 5, 6, 7, 8]
    assert batch.slot_mapping.tolist() == [8 * 4 + 1, 1 * 4 + 2, 1 * 4 + 3, 0, 1, 2, 3, 6 * 4 + 0]
    assert batch.query_start_loc.tolist() == [0, 1, 8] and batch.seq_lens.tolist() == [6, 9]
    assert batch.block_tables.tolist() == [[3, 8, 0], [1, 0, 6]] and batch.block_tables.dtype == np.int32
    assert batch.logits_rows.tolist() == [0, 7]  # the last token of each request
    assert not batch.decode_only and batch.max_seq_len == 9 and batch.query_lens == [1, 7]


def test_step_batch_samples_in_place_when_every_row_is_sampled_in_order():
    sched = _sched(([1, 2], 1, 1, [0]), ([3, 4, 5], 2, 1, [2]))
    assert build_step_batch(sched, 2, [0, 1], 16).logits_rows is None
    assert build_step_batch(sched, 2, [0, 0, 1], 16).logits_rows.tolist() == [0, 0, 1]  # forked samples
    assert build_step_batch(sched, 2, [1], 16).logits_rows.tolist() == [1]


def test_pad_decode_pads_rows_that_write_and_read_nothing():
    sched = _sched(([1, 2, 3], 2, 1, [4]), ([9] * 20, 19, 1, [0, 7]))
    batch = build_step_batch(sched, 2, [0, 1], 16)
    tokens, lens = pad_decode(batch, 4)
    assert tokens.dtype == np.int64 and lens.dtype == np.int32
    assert tokens.tolist() == [[3, 9, 0, 0], [2, 19, 0, 0], [4 * 16 + 2, 7 * 16 + 3, -1, -1]]
    assert lens.tolist() == [3, 20, 0, 0]
    with pytest.raises(ValueError):
        pad_decode(batch, 1)
    with pytest.raises(ValueError):
        pad_decode(build_step_batch(_sched(([1, 2, 3], 0, 3, [0])), 0, [0], 16), 4)


def test_warm_up_batch_writes_no_slot():
    batch = warm_up_batch(16)
    assert (batch.slot_mapping < 0).all() and batch.num_decodes == 1 and not batch.decode_only
    assert batch.query_start_loc[-1] == batch.num_tokens and batch.logits_rows.tolist() == [0, 3]


def test_uploader_on_cpu_hands_out_the_arrays_themselves():
    a = np.arange(5, dtype=np.int64)
    (t,) = Uploader(torch.device("cpu")).upload(a)
    assert t.data_ptr() == a.ctypes.data  # no copy at all


def test_uploader_staging_packs_by_dtype_aligned_and_reuses_its_buffers():
    up = Uploader(torch.device("cpu"), copy=True)  # the staging path a GPU takes, on host memory
    rng = np.random.default_rng(0)
    for step in range(4):
        arrays = [
            rng.integers(0, 100, size=3 + step, dtype=np.int64),
            rng.integers(0, 100, size=(2, 5 + step), dtype=np.int32),
            rng.integers(-1, 100, size=7, dtype=np.int64),
            rng.integers(0, 100, size=step, dtype=np.int32),
            np.arange(2000 * step, dtype=np.int64),  # grows the buffer past its first size
        ]
        got = up.upload(*arrays)
        for a, t in zip(arrays, got, strict=True):
            assert t.shape == a.shape and t.dtype == torch.from_numpy(a).dtype
            assert np.array_equal(t.numpy(), a)
            assert t.data_ptr() % 64 == 0  # Triton specialises on pointer alignment
            assert t.data_ptr() != a.ctypes.data
    buffers = {dt: t.data_ptr() for dt, t in up._device.items()}
    up.upload(np.arange(3, dtype=np.int64))
    assert {dt: t.data_ptr() for dt, t in up._device.items()} == buffers  # no allocation once big enough


def test_to_host_leaves_cpu_tensors_as_they_are():
    ids, lp = torch.tensor([1, 2]), torch.tensor([-0.5, -1.0])
    out = to_host([ids, None, lp, None])
    assert out[0] is ids and out[1] is None and out[2] is lp and out[3] is None


def test_uploader_reserved_for_the_largest_step_never_allocates_again():
    up = Uploader(torch.device("cpu"), copy=True)
    up.reserve({np.int64: 3 * 512 + 16, np.int32: 2 * 16 + 1 + 16 * 64})
    buffers = {dt: (up._host[dt].data_ptr(), t.data_ptr()) for dt, t in up._device.items()}
    for tokens, seqs, width in [(512, 16, 64), (1, 1, 1), (300, 7, 33)]:  # 6 arrays, each aligned
        up.upload(
            np.zeros(tokens, np.int64),
            np.zeros(tokens, np.int64),
            np.zeros(tokens, np.int64),
            np.zeros(seqs + 1, np.int32),
            np.zeros(seqs, np.int32),
            np.zeros((seqs, width), np.int32),
            np.zeros(seqs, np.int64),
        )
        assert {dt: (up._host[dt].data_ptr(), t.data_ptr()) for dt, t in up._device.items()} == buffers
